"""Serving benchmarks against a real TorchServe and its peers (vLLM's CPU build): serve.py (one command,
its scenarios in levels.py, prefix.py and versus_cli.py) and soak.py; the clients, servers and peers they
share beside them."""
