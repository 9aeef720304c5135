"""Benchmarks of the kernels and the CPU's limits: matmuls, prompt attention, sampling, arithmetic peak."""
