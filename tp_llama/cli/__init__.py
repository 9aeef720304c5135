"""Command-line tools: the offline generator (generate)."""
