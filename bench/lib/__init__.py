"""What the benchmarks share: synthetic checkpoints, measuring and reporting helpers, prompts. No
benchmark imports another benchmark; they import from here."""
