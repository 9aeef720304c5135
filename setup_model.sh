#!/usr/bin/env bash
# Set up tp-llama-serve and, with --serve, run it: a tensor-parallel Llama on TorchServe.
#
#   ./setup_model.sh [--ckpt-dir DIR] [--tp N] [--threads N] [--set KEY=VALUE ...] [--name NAME]
#                    [--model-store DIR] [--serve] [--management]
#
# Safe to run again: every step skips work that is already done.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$REPO/.venv"
PY="$VENV/bin/python"
DEFAULT_CKPT="$REPO/checkpoints/synthetic-llama2"

CKPT_DIR=""
CKPT_ARG=""
TP=2
THREADS=""
SETS=()
NAME="llama"
MODEL_STORE="$REPO/model_store"
SERVE=0
MANAGEMENT=0
INFERENCE_PORT="${INFERENCE_PORT:-8080}"
MANAGEMENT_PORT="${MANAGEMENT_PORT:-8081}"
MANAGEMENT_SOCKET="${MANAGEMENT_SOCKET:-}"
METRICS_PORT="${METRICS_PORT:-8082}"
GRPC_INFERENCE_PORT="${GRPC_INFERENCE_PORT:-7070}"
GRPC_MANAGEMENT_PORT="${GRPC_MANAGEMENT_PORT:-7071}"
READY_TIMEOUT="${READY_TIMEOUT:-1800}"

usage() {
  cat <<EOF
Usage: ./setup_model.sh [--ckpt-dir DIR] [--tp N] [--threads N] [--set KEY=VALUE ...] [--name NAME]
                        [--model-store DIR] [--serve] [--management]

  --ckpt-dir DIR     Meta Llama checkpoint folder (params.json, tokenizer.model,
                     consolidated.NN.pth). Default: a small random-weight Llama 2
                     checkpoint written to checkpoints/synthetic-llama2.
  --tp N             tensor-parallel ranks per worker (torchrun nproc-per-node). Default 2.
  --threads N        CPU threads per rank (torchrun.OMP_NUMBER_THREADS). Default: the cores this
                     worker may use (affinity, cgroup quota) divided by its ranks, logged at load.
  --set KEY=VALUE    set a key of the model folder's model-config.yaml, dotted, the value read as
                     YAML (repeatable): --set handler.max_seq_len=8192 --set batchSize=100.
                     Checked now: an unknown key or a wrong type stops setup, naming it. A rerun
                     rebuilds the folder from model-config.yaml: give the same --set again.
  --name NAME        model name in the URL /predictions/NAME. Default llama.
  --model-store DIR  where the model folder NAME is written. Default model_store.
  --serve            start TorchServe on 127.0.0.1, wait for the model, send a sample request.
  --management       with --serve: put the management API on 127.0.0.1:MANAGEMENT_PORT and turn
                     on its model API (register/unregister models). Without it the management
                     API listens only on the unix socket MODEL_STORE/management.sock (no TCP
                     port) and the model API is off.

Every listener is on 127.0.0.1 and token authorization stays on (keys in key_file.json);
deploy/server_config.py writes MODEL_STORE/config.properties. See README.md, Security.

Ports (environment): INFERENCE_PORT=$INFERENCE_PORT MANAGEMENT_PORT=$MANAGEMENT_PORT (only with --management)
METRICS_PORT=$METRICS_PORT GRPC_INFERENCE_PORT=$GRPC_INFERENCE_PORT GRPC_MANAGEMENT_PORT=$GRPC_MANAGEMENT_PORT
MANAGEMENT_SOCKET=${MANAGEMENT_SOCKET:-MODEL_STORE/management.sock} READY_TIMEOUT=$READY_TIMEOUT (seconds)
EOF
}

step() { printf '\n==> %s\n' "$*"; }
die() { printf 'setup_model.sh: error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --ckpt-dir) [ $# -ge 2 ] || die "--ckpt-dir needs a value"; CKPT_DIR="$2"; CKPT_ARG="$2"; shift 2 ;;
    --tp) [ $# -ge 2 ] || die "--tp needs a value"; TP="$2"; shift 2 ;;
    --threads) [ $# -ge 2 ] || die "--threads needs a value"; THREADS="$2"; shift 2 ;;
    --set) [ $# -ge 2 ] || die "--set needs KEY=VALUE"; [[ "$2" == ?*=* ]] || die "--set needs KEY=VALUE, got '$2'"
      SETS+=("$2"); shift 2 ;;
    --name) [ $# -ge 2 ] || die "--name needs a value"; NAME="$2"; shift 2 ;;
    --model-store) [ $# -ge 2 ] || die "--model-store needs a value"; MODEL_STORE="$2"; shift 2 ;;
    --serve) SERVE=1; shift ;;
    --management) MANAGEMENT=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
[[ "$TP" =~ ^[1-9][0-9]*$ ]] || die "--tp must be a positive integer, got '$TP'"
if [ -n "$THREADS" ]; then
  [[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer, got '$THREADS'"
  SETS+=("torchrun.OMP_NUMBER_THREADS=$THREADS")
fi
[[ "$NAME" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] || die "--name may use letters, digits, '_', '.', '-'"
if [ "$MANAGEMENT" = 1 ] && [ "$SERVE" = 0 ]; then die "--management only makes sense with --serve"; fi
mkdir -p "$MODEL_STORE"
MODEL_STORE="$(cd "$MODEL_STORE" && pwd)"
MANAGEMENT_SOCKET="${MANAGEMENT_SOCKET:-$MODEL_STORE/management.sock}"

setup_python() {
  step "[1/4] Python environment ($VENV)"
  if [ ! -x "$PY" ]; then
    command -v python3 >/dev/null || die "python3 (3.10 or newer) is needed"
    python3 -m venv "$VENV"
  fi
  local stamp="$VENV/.tp-llama-serve-installed"
  local want
  want="$(cat "$REPO/requirements.txt" "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "requirements already installed"
  else
    "$PY" -m pip install -r "$REPO/requirements.txt"
    "$PY" -m pip install --no-deps -e "$REPO"
    echo "$want" > "$stamp"
  fi
  "$PY" -c "import torch, ts, model_archiver, tp_llama; print('torch', torch.__version__)"
  # The C kernels, built once for this machine now rather than by the first worker to start.
  "$PY" -m tp_llama.kernels.cpu
}

java_major() {
  java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1
}

setup_java() {
  step "[2/4] Java 17 for the TorchServe frontend"
  local major=""
  if command -v java >/dev/null; then major="$(java_major)"; fi
  if [ -z "$major" ] || [ "$major" -lt 17 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "installing openjdk-17-jre-headless"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null
      major="$(java_major)"
    else
      die "Java 17 is needed (found: ${major:-none}); install openjdk-17-jre-headless"
    fi
  fi
  echo "java $major: $(command -v java)"
}

setup_checkpoint() {
  step "[3/4] Checkpoint"
  if [ -z "$CKPT_DIR" ]; then
    CKPT_DIR="$DEFAULT_CKPT"
    if [ -f "$CKPT_DIR/params.json" ]; then
      echo "synthetic checkpoint already at $CKPT_DIR"
    else
      echo "writing a small random-weight Llama 2 checkpoint (2 shard files) to $CKPT_DIR"
      "$PY" -m tp_llama.synthetic "$CKPT_DIR" --family llama2 --mp 2
    fi
  fi
  [ -d "$CKPT_DIR" ] || die "checkpoint folder $CKPT_DIR does not exist"
  CKPT_DIR="$(cd "$CKPT_DIR" && pwd)"
  [ -f "$CKPT_DIR/params.json" ] || die "$CKPT_DIR has no params.json"
  [ -f "$CKPT_DIR/tokenizer.model" ] || die "$CKPT_DIR has no tokenizer.model"
  local shards
  # -H: a --ckpt-dir that is a symlink (to another disk, say) is the folder it points to.
  shards="$(find -H "$CKPT_DIR" -maxdepth 1 -name 'consolidated.*.pth' | wc -l)"
  [ "$shards" -ge 1 ] || die "$CKPT_DIR has no consolidated.*.pth files"
  echo "using $CKPT_DIR ($shards shard file(s)), served with tensor parallelism $TP"
}

build_archive() {
  step "[4/4] Model archive $MODEL_STORE/$NAME (weights stay in $CKPT_DIR)"
  local sets=() assignment
  for assignment in ${SETS[@]+"${SETS[@]}"}; do sets+=(--set "$assignment"); done
  "$PY" "$REPO/deploy/make_archive.py" --ckpt-dir "$CKPT_DIR" --tp "$TP" --name "$NAME" --model-store "$MODEL_STORE" \
    ${sets[@]+"${sets[@]}"} || die "could not write the model folder $MODEL_STORE/$NAME"
}

# Loopback only, token authorization on, management on a unix socket unless --management.
write_server_config() {
  CONFIG="$MODEL_STORE/config.properties"
  local where=(--management-socket "$MANAGEMENT_SOCKET") out
  if [ "$MANAGEMENT" = 1 ]; then where=(--management-port "$MANAGEMENT_PORT"); fi
  # Lines added by hand to an earlier config.properties (token_expiration_min=N, ...) are kept.
  out="$("$PY" "$REPO/deploy/server_config.py" write --model-store "$MODEL_STORE" --out "$CONFIG" \
    --inference-port "$INFERENCE_PORT" --metrics-port "$METRICS_PORT" \
    --grpc-inference-port "$GRPC_INFERENCE_PORT" --grpc-management-port "$GRPC_MANAGEMENT_PORT" \
    --keep-from "$CONFIG" "${where[@]}")" || die "could not write $CONFIG"
  printf '%s\n' "$out" | grep '^kept' || true
}

# True while the pid in TorchServe's pid file is a live (not zombie) process.
server_running() {
  local state
  [ -f "$1" ] || return 1
  state="$(ps -o stat= -p "$(cat "$1")" 2>/dev/null || true)"
  [ -n "$state" ] && [[ "$state" != Z* ]]
}

port_busy() {
  "$PY" - "$1" <<'EOF'
import socket, sys
with socket.socket() as s:
    s.settimeout(1)
    sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
EOF
}

unix_socket_answers() {
  "$PY" - "$1" <<'EOF'
import socket, sys
with socket.socket(socket.AF_UNIX) as s:
    s.settimeout(2)
    sys.exit(0 if s.connect_ex(sys.argv[1]) == 0 else 1)
EOF
}

# Prints the worker states of the model ("READY" when it can answer), or nothing; asks the
# management API wherever the config put it (the unix socket, or the port with --management).
model_status() {
  "$PY" "$REPO/deploy/server_config.py" model-status --config "$CONFIG" --name "$NAME" \
    --key-file "$REPO/key_file.json" 2>/dev/null || true
}

sample_request() {
  local synthetic=0
  if [ -z "$CKPT_ARG" ] || [ "$CKPT_DIR" = "$DEFAULT_CKPT" ]; then synthetic=1; fi
  "$PY" - "$INFERENCE_PORT" "$NAME" "$synthetic" <<'EOF'
import json, sys, time, urllib.request
key = json.load(open("key_file.json"))["inference"]["key"]
body = {"prompt": "The capital of France is", "max_new_tokens": 32, "temperature": 0}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/predictions/{sys.argv[2]}",
                             data=json.dumps(body).encode(), method="POST",
                             headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
started = time.monotonic()
with urllib.request.urlopen(req, timeout=600) as resp:
    reply = json.load(resp)
print(f"request: {json.dumps(body)}")
print(f"completion ({time.monotonic() - started:.2f} s): {reply['text']!r}")
print(f"token_ids: {reply['token_ids']}")
print(f"finish_reason: {reply['finish_reason']}, usage: {reply['usage']}")
if sys.argv[3] == "1":
    print("\nNote: this is the demo checkpoint, a tiny Llama 2 with RANDOM weights (made by tp_llama.synthetic),\n"
          "so the completion above is gibberish by design: it only shows that the tokenizer, the tensor-\n"
          "parallel ranks and TorchServe work end to end. Serve a real Meta Llama checkpoint with\n"
          "--ckpt-dir (e.g. Llama-2-7b or Meta-Llama-3-8B) and the same request gives a real answer\n"
          "(' Paris.' or similar).")
EOF
}

serve() {
  local management_where="unix socket $MANAGEMENT_SOCKET, model API off"
  if [ "$MANAGEMENT" = 1 ]; then management_where="127.0.0.1:$MANAGEMENT_PORT, model API on"; fi
  step "Starting TorchServe on 127.0.0.1:$INFERENCE_PORT (token authorization on; management: $management_where)"
  export PATH="$VENV/bin:$PATH"
  cd "$REPO"
  local pid_file
  pid_file="$("$PY" -c 'import os, tempfile; print(os.path.join(tempfile.gettempdir(), ".model_server.pid"))')"
  if server_running "$pid_file"; then
    echo "stopping the TorchServe already running (pid $(cat "$pid_file"))"
    "$VENV/bin/torchserve" --stop >/dev/null 2>&1 || true
  fi
  local port waited ports=("$INFERENCE_PORT" "$METRICS_PORT" "$GRPC_INFERENCE_PORT" "$GRPC_MANAGEMENT_PORT")
  if [ "$MANAGEMENT" = 1 ]; then ports+=("$MANAGEMENT_PORT"); fi
  for port in "${ports[@]}"; do
    waited=0
    while port_busy "$port" && [ "$waited" -lt 30 ]; do sleep 1; waited=$((waited + 1)); done
    if port_busy "$port"; then die "port $port on 127.0.0.1 is in use; free it or set the *_PORT variables (--help)"; fi
  done
  write_server_config
  # A socket file left by a server that did not stop cleanly would block the bind; one that
  # still answers belongs to a TorchServe started elsewhere, which is left alone.
  if [ -S "$MANAGEMENT_SOCKET" ]; then
    if unix_socket_answers "$MANAGEMENT_SOCKET"; then
      die "a server is listening on $MANAGEMENT_SOCKET; stop it, or set MANAGEMENT_SOCKET (--help)"
    fi
    rm -f "$MANAGEMENT_SOCKET"
  fi
  rm -f key_file.json
  mkdir -p logs
  "$VENV/bin/torchserve" --start --ncs --ts-config "$CONFIG" --model-store "$MODEL_STORE" \
    --models "$NAME=$NAME" > logs/torchserve.out 2>&1
  echo "config: $CONFIG; logs: $REPO/logs/ (model_log.log has the ranks' output)"

  step "Waiting for the $TP-rank worker to load the checkpoint (up to $READY_TIMEOUT s)"
  local started=$SECONDS status="" report=$((SECONDS + 15))
  while [ $((SECONDS - started)) -lt "$READY_TIMEOUT" ]; do
    status="$(model_status)"
    if [[ "$status" == *READY* ]]; then break; fi
    if ! server_running "$pid_file"; then
      tail -n 40 logs/torchserve.out logs/model_log.log 2>/dev/null || true
      die "TorchServe exited; see logs/"
    fi
    # TorchServe retries a failed load for good, with back-off: the first failure's cause is shown at once.
    if grep -q "Load model failed" logs/torchserve.out 2>/dev/null; then
      tail -n 40 logs/model_log.log 2>/dev/null || true
      "$VENV/bin/torchserve" --stop >/dev/null 2>&1 || true
      die "the worker failed to load the model (the ranks' output above; all of it in logs/); TorchServe stopped"
    fi
    if [ "$SECONDS" -ge "$report" ]; then
      echo "  ... still loading after $((SECONDS - started)) s"
      report=$((SECONDS + 15))
    fi
    sleep 2
  done
  if [[ "$status" != *READY* ]]; then
    tail -n 40 logs/model_log.log 2>/dev/null || true
    "$VENV/bin/torchserve" --stop >/dev/null 2>&1 || true
    die "model not ready after $READY_TIMEOUT s; TorchServe stopped; see logs/"
  fi
  echo "model $NAME ready after $((SECONDS - started)) s"

  step "Sample request"
  sample_request

  local management_url="--unix-socket $MANAGEMENT_SOCKET http://localhost"
  if [ "$MANAGEMENT" = 1 ]; then management_url="http://127.0.0.1:$MANAGEMENT_PORT"; fi
  local token_url="--unix-socket $MANAGEMENT_SOCKET 'http://localhost/token?type=inference'"
  if [ "$MANAGEMENT" = 1 ]; then token_url="'http://127.0.0.1:$MANAGEMENT_PORT/token?type=inference'"; fi
  cat <<EOF

TorchServe is running, on loopback only, with token authorization. Keys: $REPO/key_file.json
Query it:
  KEY=\$($PY -c "import json; print(json.load(open('$REPO/key_file.json'))['inference']['key'])")
  curl -s http://127.0.0.1:$INFERENCE_PORT/predictions/$NAME -H "Authorization: Bearer \$KEY" \\
       -H 'Content-Type: application/json' -d '{"prompt": "Once upon a time", "max_new_tokens": 32}'
  curl -sN http://127.0.0.1:$INFERENCE_PORT/predictions/$NAME -H "Authorization: Bearer \$KEY" \\
       -H 'Content-Type: application/json' -d '{"messages": [{"role": "user", "content": "Hi!"}], "stream": true}'
Management API ($management_where):
  MKEY=\$($PY -c "import json; print(json.load(open('$REPO/key_file.json'))['management']['key'])")
  curl -s $management_url/models/$NAME -H "Authorization: Bearer \$MKEY"
The inference key expires after 60 minutes. A new one (the old one stops working at once;
key_file.json gets the new one, read KEY again):
  AKEY=\$($PY -c "import json; print(json.load(open('$REPO/key_file.json'))['API']['key'])")
  curl -s -X POST $token_url -H "Authorization: Bearer \$AKEY"
Stop it:
  (cd $REPO && $VENV/bin/torchserve --stop)
EOF
}

setup_python
setup_java
setup_checkpoint
build_archive
if [ "$SERVE" = 1 ]; then
  serve
else
  again=""
  for assignment in ${SETS[@]+"${SETS[@]}"}; do again+=" --set $(printf '%q' "$assignment")"; done
  printf '\nDone. To serve it: ./setup_model.sh%s --tp %s%s --name %s --model-store %q --serve\n' \
    "${CKPT_ARG:+ --ckpt-dir $(printf '%q' "$CKPT_DIR")}" "$TP" "$again" "$NAME" "$MODEL_STORE"
fi
