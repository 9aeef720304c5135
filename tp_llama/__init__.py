"""Serve Meta consolidated Llama checkpoints with tensor parallelism."""
