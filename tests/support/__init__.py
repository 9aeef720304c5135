"""Helpers the tests and the benchmarks share: rank launchers, the float64 reference model, a live TorchServe, the hostile request corpus."""
