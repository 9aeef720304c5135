"""Acceptance checks: pass or fail on the machine at hand, unlike the benchmarks in bench/, which measure."""
