"""Benchmarks: serving/ (TorchServe and its peers), engine/ (the offline engine), kernels/ (the C
kernels and the CPU's limits), on helpers from lib/; bench/README.md says how to run each."""
