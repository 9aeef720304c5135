#!/usr/bin/env bash
# The benchmarks README.md and BENCHMARKS.md quote, with one command: installs the bench-only packages
# into the project's venv; runs the first suite (loading, generation, TorchServe against the offline
# CLI) and rewrites its results in BENCHMARKS.md; then sets up vLLM's CPU build and runs the README's
# headline table, ours against vLLM, in its three rows; then llama.cpp and ours quantized. Hours on a
# 2-core VM; run it alone.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "run ./setup_model.sh first (it creates .venv)" >&2; exit 1; }
"$PY" -m pip install -q -r bench/requirements.txt
"$PY" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

step() {  # step NAME COMMAND...: run the command, then say how long it took
    local name=$1 started=$SECONDS
    shift
    printf '\n==> %s\n' "$name"
    "$@"
    echo "==> $name took $((SECONDS - started)) s"
}

# The first suite: each part prints its table and writes bench/out/NAME.json (load, generate, serve);
# bench.report turns them into bench/benchmarks.png and the results section of BENCHMARKS.md.
step load "$PY" -m bench.engine.load
step generate "$PY" -m bench.engine.generate
step serve "$PY" -m bench.serving.serve --scenario cli
"$PY" -m bench.report

# The README's headline (its "Performance" section): a random-weight Llama 3.2 1B shape, ours TP 1 x 2
# threads against vLLM's CPU build on both cores, taking turns for three rounds.
bash bench/setup_vllm.sh
headline=(-m bench.serving.serve --scenario levels --servers ours vllm --preset llama3.2-1b --tp 1
          --omp-threads 2 --skip-scenarios --prompt-len 200 --new-tokens 64 --concurrency 1 8 32 --rounds 3)
step "headline: bfloat16, greedy" "$PY" "${headline[@]}" --dtype bfloat16 --sampling greedy --out bench_cb
step "headline: bfloat16, temperature 0.6 top_p 0.9" "$PY" "${headline[@]}" --dtype bfloat16 \
    --sampling default-unseeded --out bench_cb-sampled
step "headline: float32, greedy" "$PY" "${headline[@]}" --dtype float32 --sampling greedy --out bench_cb-float32

# Issue 46's speed table: ours at 16, 8 and 4 bits against llama.cpp (built once for this CPU) on the
# same weights in BF16, Q8_0, Q4_0 and Q4_K_M, and vLLM, all taking turns for five rounds.
bash bench/setup_llamacpp.sh
step "quantized: ours against llama.cpp" "$PY" -m bench.serving.serve --scenario levels --servers ours ours-int8 \
    ours-int4 vllm llamacpp-bf16 llamacpp-q8_0 llamacpp-q4_0 llamacpp-q4_k_m --preset llama3.2-1b --dtype bfloat16 \
    --tp 1 --omp-threads 2 --skip-scenarios --prompt-len 200 --new-tokens 64 --concurrency 1 8 --sampling greedy \
    --rounds 5 --out bench_cb-llamacpp
