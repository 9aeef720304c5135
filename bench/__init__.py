"""Benchmarks: loading, generation and serving, against the floor and the alternatives."""
