"""Concurrency levels (`--scenario levels`): this checkout (at 16, 8 and 4 bits), an older one, vLLM's CPU build
and llama.cpp, in one run.

    bash bench/setup_vllm.sh                                   # once: bench/out/vllm-venv
    bash bench/setup_llamacpp.sh                               # once: bench/out/llama.cpp
    .venv/bin/python -m bench.serving.serve --scenario levels --before COMMIT_OR_PATH [--dtype float32|bfloat16]
        [--tp 2] [--omp-threads 1] [--yaml KEY=VALUE ...] [--yaml-before KEY=VALUE ...]
        [--concurrency 1 4 16 32] [--requests 2] [--prompt-len 128] [--new-tokens 128] [--quick]
    .venv/bin/python -m bench.serving.serve --report bench/out/bench_cb.json   # tables and plot again

Servers, one at a time (only one is up while another is measured, the machine has few cores), or with
--rounds R all up at once, taking turns (below):
- "ours": TorchServe with the handler built from this checkout (deploy/make_archive.build_archive),
  TP --tp ranks of --omp-threads OpenMP threads each, dtype --dtype; --yaml KEY=VALUE sets any key
  of the archive's model-config.yaml (e.g. continuousBatching=true, handler.max_batch_size=32).
- "before": the same from an older checkout: a folder, or a commit checked out with
  `git worktree add` under bench/out/; its own make_archive.py builds its archive
  (--yaml-before for its keys: an older handler refuses keys it does not know).
- "ours-int8", "ours-int4": "ours" with handler.quantize=int8 / int4 (before the --yaml overrides).
- "vllm": vLLM's CPU build on the same weights converted to a Hugging Face folder, with
  --skip-tokenizer-init; prompts go as token ids to /v1/completions.
- "llamacpp-KIND" (KIND f32, bf16, q8_0, q4_0, q4_k_m): llama.cpp's llama-server on the same weights,
  an F32 GGUF written from the MP 1 checkpoint and llama-quantize's KIND of it (made once under
  bench/out/gguf; bench/serving/llamacpp_peer.py), --llamacpp-threads threads, a slot per client of the
  largest level, each of --llamacpp-ctx positions, prompt caching off; prompts go as token ids to its
  /completion. The tables pair ours-int8 with llamacpp-q8_0, ours-int4 with llamacpp-q4_0 and q4_k_m.

The prompt is a fixed list of --prompt-len token ids (BOS + corpus text, as the handler encodes it):
vLLM and llama.cpp get the ids, our servers the text; each server's usage.prompt_tokens is checked
against the list's length, and the first greedy tokens of ours are compared with vLLM's (and the
quantized and llama.cpp servers' with ours'). Every request sends that one prompt, so every server runs
with prefix caching off (ours and before: handler.prefix_caching=false before the --yaml / --yaml-before overrides; llama.cpp:
no prompt cache; `--scenario prefix` measures the cache against vLLM's).

Per concurrency level, each of C clients sends --requests streaming requests back to back (stop
tokens ignored, --new-tokens each): greedy, or with --sampling default the yaml's default
temperature 0.6 and top_p 0.9, each request with its own seed (the same seeds for every server). Output tokens/s = all output tokens / wall time of the
level; TTFT = first streamed chunk; TPOT = (latency - TTFT) / (tokens - 1).
--rounds R (R > 1): every server starts first and waits while another is measured; each level then
runs R times per server, the servers taking turns (ours, vllm, then vllm, ours, ...), so each round's
runs are minutes apart at most. A cloud VM's memory bandwidth can change by half between runs
minutes apart; a ratio of two runs side by side in time is what stays. The report gives each
level's median over the rounds and the ratio per round (its median and range), and the CPU seconds
the waiting servers used meanwhile (idle_cpu_s: near zero, or the turns disturb each other). Each
turn starts once the servers are quiet (vLLM's OpenMP threads spin on for a second after a run).
Latency scenarios, for ours and before (bench/serving/latency.py):
- short behind long: an 8-token request sent 0.5 s after a 256-token one, vs the 8-token one alone;
- disconnects: 8 streaming clients start 512-token requests and disconnect after their first chunk;
  0.5 s after the last one has gone, a 16-token request, vs the same request alone.
Raw numbers: bench/out/bench_cb.json (each level's "timeline": every request's send time from
the level's start, TTFT and latency, seconds, to see the waves); plot: bench/out/bench_cb.png
(needs matplotlib, from bench/requirements.txt).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path


from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import OUT, REPO, before_root, write_json
from bench.lib.generation import prompt_text
from bench.lib.llamacpp import cpu_flags
from bench.serving.clients import SAMPLING, Send, openai_stream, run_level, sampling_fields, torchserve_stream
from bench.serving.latency import scenarios
from bench.serving.levels_report import SERVERS, ours_like, plot, report
from bench.serving.llamacpp_peer import LlamaServer, gguf_for, llamacpp_stream, llamacpp_tokens
from bench.serving.llamacpp_peer import version as llamacpp_version
from bench.serving.servers import (NAME, archive, git_describe, own_rendezvous, start_ready, vllm_folder,
                                   vllm_version)
from bench.serving.turns import cpu_seconds, settle
from bench.serving.vllm_peer import VLLM_VENV, VLLMServer, vllm_stream
from tests.support.serving_util import TorchServe, free_ports
from tp_llama.tokenizer import load_tokenizer

WORK = OUT / "bench_cb"
DEFAULT_SERVERS = ("ours", "before", "vllm")


# ---------------------------------------------------------------------------- servers

def start_torchserve(label: str, root: Path, ckpt: Path, a: argparse.Namespace, overrides: list[str],
                     ids: list[int], text: str, stack: contextlib.ExitStack) -> tuple[dict, Send, TorchServe]:
    """Our server from `root`, up and warmed (stopped when `stack` closes): its result so far and its sender."""
    work = WORK / label
    shutil.rmtree(work, ignore_errors=True)
    common = [own_rendezvous(), f"torchrun.OMP_NUMBER_THREADS={a.omp_threads}", f"handler.dtype={a.dtype}"]
    folder = archive(root, ckpt, work / "model_store", a.tp, common + overrides)
    result: dict = {"root": str(root), "overrides": common + overrides,
                    "commit": git_describe(root)}
    server = TorchServe(work, folder.parent, NAME)
    stack.callback(lambda: result.update(stop=server.stop()))  # the stop, and what it left
    result["ready_s"] = start_ready(server)
    print(f"[{label}] ready after {result['ready_s']:.0f} s ({root})", flush=True)
    fields = sampling_fields(a.sampling)
    send = lambda p, n: torchserve_stream(server, p, n, a.timeout, fields=fields())  # noqa: E731
    if label.startswith("ours") and a.api == "openai":  # the same prompt ids through /v1/completions
        auth = {"Authorization": f"Bearer {server.keys()['inference']}"}
        path = f"/predictions/{NAME}/1.0/v1/completions"
        send = lambda p, n: openai_stream(server.inference_port, path, ids, n, auth, fields(), a.timeout)  # noqa: E731
    warm = torchserve_stream(server, text, a.check_tokens, a.timeout)  # greedy: compared with vLLM's
    result["prompt_tokens"] = warm["prompt_tokens"]
    result["first_tokens"] = warm["token_ids"]
    if warm["prompt_tokens"] != len(ids):
        print(f"[{label}] WARNING: the server counts {warm['prompt_tokens']} prompt tokens, vLLM gets {len(ids)}",
              flush=True)
    return result, send, server


def start_vllm(ckpt_mp1: Path, a: argparse.Namespace, ids: list[int],
               stack: contextlib.ExitStack) -> tuple[dict, Send, VLLMServer]:
    """vLLM on the same weights, up and warmed (stopped when `stack` closes): its result so far and its sender."""
    work, max_len = WORK / "vllm", a.vllm_max_model_len
    hf_dir, port = vllm_folder(ckpt_mp1, work, max_len)
    result: dict = {"hf_dir": str(hf_dir), "venv": str(VLLM_VENV)}
    server = VLLMServer(hf_dir, port, work, a.dtype, max_len, cores=a.vllm_cores, kv_gib=a.vllm_kv_gib,
                        extra_args=a.vllm_arg)
    stack.callback(lambda: result.update(stop_returncode=server.stop()))
    server.start()
    result["ready_s"] = server.wait_ready(timeout=900)
    result["version"] = vllm_version()
    print(f"[vllm] ready after {result['ready_s']:.0f} s", flush=True)
    fields = sampling_fields(a.sampling)
    send = lambda p, n: vllm_stream(port, p, n, a.timeout, fields())  # noqa: E731
    warm = vllm_stream(port, ids, a.check_tokens, a.timeout)  # greedy: compared with ours
    result["prompt_tokens"] = warm["prompt_tokens"]
    result["first_tokens"] = warm["token_ids"]
    return result, send, server


def llamacpp_ctx(a: argparse.Namespace, prompt_tokens: int) -> int:
    """Positions per slot: --llamacpp-ctx, or the prompt and the longest request rounded up to 256."""
    return a.llamacpp_ctx or 256 * -(-(prompt_tokens + max(a.new_tokens, a.check_tokens) + 1) // 256)


def start_llamacpp(kind: str, ckpt_mp1: Path, a: argparse.Namespace, ids: list[int],
                   stack: contextlib.ExitStack) -> tuple[dict, Send, LlamaServer]:
    """llama-server on the same weights in `kind`, up and warmed (stopped when `stack` closes)."""
    label, work = f"llamacpp-{kind}", WORK / f"llamacpp-{kind}"
    shutil.rmtree(work, ignore_errors=True)
    gguf = gguf_for(ckpt_mp1, kind, a.llamacpp_threads)
    server = LlamaServer(gguf, free_ports(1)[0], work, max(a.concurrency), llamacpp_ctx(a, len(ids)),
                         a.llamacpp_threads, a.llamacpp_arg)
    result: dict = {"gguf": str(gguf), "version": llamacpp_version(), "command": server.command}
    stack.callback(lambda: result.update(stop_returncode=server.stop()))
    server.start()
    result["ready_s"] = server.wait_ready(timeout=900)
    print(f"[{label}] ready after {result['ready_s']:.0f} s", flush=True)
    fields = sampling_fields(a.sampling)
    send = lambda p, n: llamacpp_stream(server.port, p, n, a.timeout, fields())  # noqa: E731
    warm = llamacpp_tokens(server.port, ids, a.check_tokens, a.timeout)  # greedy: compared with ours
    result["prompt_tokens"] = warm["prompt_tokens"]
    result["first_tokens"] = warm["token_ids"]
    return result, send, server


def start(name: str, a: argparse.Namespace, roots: dict[str, Path], ids: list[int], text: str,
          stack: contextlib.ExitStack) -> tuple[dict, Send, TorchServe | VLLMServer | LlamaServer]:
    """Server `name` up and warmed; every one runs with prefix caching off (one prompt for all)."""
    if name == "vllm":
        return start_vllm(ensure_checkpoint(PRESETS[a.preset], mp=1), a, ids, stack)
    if name.startswith("llamacpp-"):
        return start_llamacpp(name.removeprefix("llamacpp-"), ensure_checkpoint(PRESETS[a.preset], mp=1), a, ids,
                              stack)
    ckpt = ensure_checkpoint(PRESETS[a.preset], mp=a.tp)
    if name == "before":
        return start_torchserve(name, roots[name], ckpt, a, ["handler.prefix_caching=false", *a.yaml_before], ids, text,
                                stack)
    quantize = name.partition("-")[2] or "none"  # ours, ours-int8, ours-int4
    overrides = ["handler.prefix_caching=false", f"handler.quantize={quantize}", *a.yaml]
    return start_torchserve(name, REPO, ckpt, a, overrides, ids, text, stack)


def taking_turns(sends: dict[str, Send], processes: dict[str, subprocess.Popen | None],
                 prompts: dict[str, list[int] | str], a: argparse.Namespace) -> dict[str, list[dict]]:
    """Each level a.rounds times per server, the servers taking turns, order reversed every round."""
    names = list(sends)
    out: dict[str, list[dict]] = {name: [] for name in names}
    for clients in a.concurrency:
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(a.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                waiting = [n for n in names if n != name]
                settled_s = settle(list(processes.values()))
                idle_before = sum(cpu_seconds(processes[n]) for n in waiting)
                level = run_level(sends[name], prompts[name], clients, a.requests, a.new_tokens)
                level["idle_cpu_s"] = sum(cpu_seconds(processes[n]) for n in waiting) - idle_before
                level["round"], level["settled_s"] = r, settled_s
                runs[name].append(level)
                print(f"[{name}] {clients} client(s), round {r + 1}: {level['tokens_per_s']:.1f} tok/s, TTFT p50 "
                      f"{level.get('ttft_p50_s', float('nan')):.2f} s, errors {level['errors']}, the waiting "
                      f"servers' CPU {level['idle_cpu_s']:.2f} s", flush=True)
        for name in names:
            out[name].append(median_level(runs[name]))
    return out


def median_level(rounds: list[dict]) -> dict:
    """One level's rounds as one: each number their median, the rounds kept under "rounds"."""
    level = {key: value for key, value in rounds[0].items() if key not in ("round", "settled_s")}
    for key, value in level.items():
        values = [r.get(key) for r in rounds]
        if isinstance(value, (int, float)) and key != "clients" and None not in values:
            level[key] = statistics.median(values)
    return dict(level, rounds=rounds)


def levels(label: str, send: Send, prompt: list[int] | str, a: argparse.Namespace) -> list[dict]:
    out = []
    for clients in a.concurrency:
        level = run_level(send, prompt, clients, a.requests, a.new_tokens)
        out.append(level)
        print(f"[{label}] {clients} client(s): {level['tokens_per_s']:.1f} tok/s, "
              f"TTFT p50 {level.get('ttft_p50_s', float('nan')):.2f} s, errors {level['errors']}", flush=True)
    return out


# ---------------------------------------------------------------------------- main

def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", help="older checkout: a folder or a commit (checked out under bench/out/)")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(DEFAULT_SERVERS),
                        help="which to run, in this order (before needs --before; default: ours before vllm)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--tp", type=int, default=2, help="ranks of our servers")
    parser.add_argument("--omp-threads", type=int, default=1, help="OpenMP threads per rank (torchrun.OMP_NUMBER_THREADS)")
    parser.add_argument("--api", choices=("native", "openai"), default="native",
                        help="how the clients talk to ours: the native API (prompt text) or /v1/completions "
                             "(the prompt's token ids, as vLLM gets them; our chunks carry no token ids)")
    parser.add_argument("--yaml", action="append", default=[], metavar="KEY=VALUE",
                        help="model-config.yaml override for ours, e.g. continuousBatching=true (repeatable)")
    parser.add_argument("--yaml-before", action="append", default=[], metavar="KEY=VALUE",
                        help="model-config.yaml override for before (repeatable)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                        help="greedy, or the yaml's default temperature 0.6 / top_p 0.9, seeded per request")
    parser.add_argument("--requests", type=int, default=2, help="requests per client, back to back")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--check-tokens", type=int, default=16, help="greedy tokens compared between servers")
    parser.add_argument("--skip-scenarios", action="store_true")
    parser.add_argument("--vllm-cores", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-max-model-len", type=int, default=1024)
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    parser.add_argument("--llamacpp-threads", type=int, default=2, help="llama-server -t and -tb")
    parser.add_argument("--llamacpp-ctx", type=int, help="positions per llama-server slot (default: prompt + "
                        "new tokens, rounded up to 256)")
    parser.add_argument("--llamacpp-arg", action="append", default=[],
                        help="extra llama-server argument (repeatable; e.g. --llamacpp-arg=-fa --llamacpp-arg=off)")
    parser.add_argument("--timeout", type=float, help="seconds one request may take (default 600; 120 with --quick)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each level per server, all servers up and taking turns (1: one server at a time)")
    parser.add_argument("--quick", action="store_true", help="smoke test: concurrency 1 and 4, 1 request each")
    parser.add_argument("--out", default="bench_cb", help="name of the JSON and plot under bench/out/")
    parser.add_argument("--report", type=Path, help="print the tables and plot from a JSON of an earlier run")


def run(a: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if a.report:
        data = json.loads(a.report.read_text())
        print(report(data))
        print(f"plot: {plot(data, a.report.with_suffix('.png'))}")
        return
    if a.rounds < 1:
        parser.error("--rounds: 1 or more")
    if a.quick:
        a.concurrency, a.requests = [1, 4], 1
    a.timeout = a.timeout or (120.0 if a.quick else 600.0)
    # Stopped with SIGTERM (or SIGINT, which a backgrounded shell ignores): leave through the
    # with-blocks, so the servers are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    servers = [s for s in a.servers if s != "before" or a.before]
    if "before" in a.servers and not a.before:
        print("no --before: the older checkout is skipped", flush=True)

    roots = {"ours": REPO, **({"before": before_root(a.before)} if "before" in servers else {})}
    ckpt = ensure_checkpoint(PRESETS[a.preset], mp=a.tp)
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    text = prompt_text(ckpt, a.prompt_len)
    ids = tokenizer.encode(text, bos=True, eos=False)  # exactly what the handler feeds the model
    if len(ids) != a.prompt_len:
        print(f"note: the prompt text re-encodes to {len(ids)} tokens (asked {a.prompt_len})", flush=True)
    prompts = {name: text if ours_like(name) else ids for name in servers}

    data: dict = {"preset": a.preset, "dtype": a.dtype, "sampling": a.sampling, "tp": a.tp, "omp_threads": a.omp_threads,
                  "prompt_len": len(ids), "prompt_ids": ids, "new_tokens": a.new_tokens, "requests": a.requests,
                  "concurrency": a.concurrency, "check_tokens": a.check_tokens, "vllm_cores": a.vllm_cores,
                  "rounds": a.rounds, "ckpt": str(ckpt), "cpu_flags": cpu_flags(), "servers": {}, "failed": {}}
    if any(name.startswith("llamacpp-") for name in servers):
        data["llamacpp"] = {"version": llamacpp_version(), "threads": a.llamacpp_threads,
                            "slots": max(a.concurrency), "ctx": llamacpp_ctx(a, len(ids))}
    if a.rounds == 1:
        for name in servers:
            try:
                with contextlib.ExitStack() as stack:
                    result, send, server = start(name, a, roots, ids, text, stack)
                    data["servers"][name] = result
                    result["levels"] = levels(name, send, prompts[name], a)
                    if ours_like(name) and not a.skip_scenarios:
                        scenarios(name, server, text, a, result)
            except Exception as exc:  # one server failing still leaves the others' numbers
                data["servers"].pop(name, None)
                data["failed"][name] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
                print(f"[{name}] FAILED: {data['failed'][name]}", flush=True)
    else:
        with contextlib.ExitStack() as stack:
            up = {}
            for name in servers:
                try:
                    up[name] = start(name, a, roots, ids, text, stack)
                except Exception as exc:  # the others still take turns
                    data["failed"][name] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
                    print(f"[{name}] FAILED: {data['failed'][name]}", flush=True)
            turns = taking_turns({n: u[1] for n, u in up.items()}, {n: u[2].process for n, u in up.items()},
                                 prompts, a)
            for name, (result, _, server) in up.items():
                result["levels"] = turns[name]
                data["servers"][name] = result
                if ours_like(name) and not a.skip_scenarios:
                    scenarios(name, server, text, a, result)
    path = write_json(a.out, data)
    print(report(json.loads(path.read_text())))  # as written: with the machine write_json adds
    print(f"raw numbers: {path}")
    print(f"plot: {plot(data, path.with_suffix('.png'))}")

