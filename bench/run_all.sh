#!/usr/bin/env bash
# All benchmarks with one command: installs the bench-only packages into the project's venv,
# then runs loading, generation and serving, and rewrites the results in BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "run ./setup_model.sh first (it creates .venv)" >&2; exit 1; }
"$PY" -m pip install -q -r bench/requirements.txt
"$PY" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
exec "$PY" -m bench.run_all
