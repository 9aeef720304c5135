#!/bin/bash
# Every GPU check in one call, for a machine lent for minutes: parity, the decode step's profile, the attention's
# splits and the device tests, each under its own time limit within SECONDS in all, each log in OUTDIR.
#
#     bash checks/gpu_run.sh [OUTDIR] [SECONDS]      # from the repository root; default ./gpu-logs and 570
#
# With .gpu-bundle beside the checkout (python -m checks.gpu_bundle), it goes first on PYTHONPATH. The serving
# check (python -m checks.gpu_serve, about 7 minutes) is not in it: it needs a call of its own.
set -u
out=${1:-gpu-logs}
end=$((SECONDS + ${2:-570}))
mkdir -p "$out"
export PYTHONPATH=$PWD/.gpu-bundle:$PWD PYTHONUNBUFFERED=1

step() {  # step LIMIT NAME COMMAND...: run it for at most LIMIT seconds (less if less is left), log in OUTDIR/NAME.log
    local limit=$(( end - SECONDS < $1 ? end - SECONDS : $1 )) name=$2
    shift 2
    if [ "$limit" -lt 20 ]; then echo "== $name: no time left"; return; fi
    echo "== $name (at most ${limit} s, from ${SECONDS} s): $*"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? at ${SECONDS} s"
    grep -v DEBUG "$out/$name.log" | tail -40
}

echo "commit $(git describe --always --dirty 2>/dev/null || cat .gpu-bundle/COMMIT 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
step 175 gpu_check python3 -m bench.gpu_check --skip-speed
step 150 profile python3 -m bench.gpu_profile --prompt 0
step 50 attention python3 -m bench.gpu_attention --rows 1 32 --blocks 16 --splits 2 4 8
step 600 tests python3 -m pytest -q -o addopts= -p no:cacheprovider --timeout 120 --device cuda \
    tests/test_decode_step.py tests/test_parity.py tests/test_bf16.py tests/test_prefix_cache.py tests/test_sampling.py \
    tests/test_llama4.py
echo "== done at ${SECONDS} s"
