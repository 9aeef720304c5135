"""Benchmarks of the offline engine, no HTTP: loading, bring-up, generation, a decode step, serving rounds."""
