"""Concurrency levels (`--scenario levels`): this checkout, an older one and vLLM's CPU build, in one run.

    bash bench/setup_vllm.sh                                   # once: bench/out/vllm-venv
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
- "vllm": vLLM's CPU build on the same weights converted to a Hugging Face folder, with
  --skip-tokenizer-init; prompts go as token ids to /v1/completions.

The prompt is a fixed list of --prompt-len token ids (BOS + corpus text, as the handler encodes it):
vLLM gets the ids, our servers the text; each server's usage.prompt_tokens is checked against the
list's length, and the first greedy tokens of ours are compared with vLLM's. Every request sends that
one prompt, so both servers run with prefix caching off (ours: handler.prefix_caching=false before
the --yaml overrides; `--scenario prefix` measures the cache against vLLM's).

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
import time
from pathlib import Path

import psutil

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import OUT, REPO, before_root, table, write_json
from bench.lib.generation import common_prefix, prompt_text
from bench.serving.clients import SAMPLING, Send, openai_stream, run_level, sampling_fields, torchserve_stream
from bench.serving.latency import scenarios
from bench.serving.servers import (NAME, archive, git_describe, own_rendezvous, start_ready, vllm_folder,
                                   vllm_version)
from bench.serving.vllm_peer import VLLM_VENV, VLLMServer, vllm_stream
from tests.support.serving_util import TorchServe
from tp_llama.tokenizer import load_tokenizer

WORK = OUT / "bench_cb"
SERVERS = ("ours", "before", "vllm")


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
    if label == "ours" and a.api == "openai":  # the same prompt ids through /v1/completions
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


def start(name: str, a: argparse.Namespace, roots: dict[str, Path], ids: list[int], text: str,
          stack: contextlib.ExitStack) -> tuple[dict, Send, TorchServe | VLLMServer]:
    """Server `name` up and warmed; ours runs with prefix caching off, as vLLM (one prompt for all)."""
    if name == "vllm":
        return start_vllm(ensure_checkpoint(PRESETS[a.preset], mp=1), a, ids, stack)
    ckpt = ensure_checkpoint(PRESETS[a.preset], mp=a.tp)
    overrides = ["handler.prefix_caching=false", *a.yaml] if name == "ours" else a.yaml_before
    return start_torchserve(name, roots[name], ckpt, a, overrides, ids, text, stack)


def cpu_seconds(process: subprocess.Popen | None) -> float:
    """User and system CPU seconds of a server's process tree so far (its live processes')."""
    if process is None:
        return 0.0
    try:
        root = psutil.Process(process.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def settle(processes: dict[str, subprocess.Popen | None], quiet_cpu_s: float = 0.02, window_s: float = 0.5,
           timeout_s: float = 30.0) -> float:
    """Seconds until the servers together use under quiet_cpu_s of CPU in window_s: a server's threads
    can spin on for a second after its turn (vLLM's OpenMP), eating into the next server's."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        before = sum(cpu_seconds(p) for p in processes.values())
        time.sleep(window_s)
        if sum(cpu_seconds(p) for p in processes.values()) - before < quiet_cpu_s:
            break
    return time.monotonic() - started


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
                settled_s = settle(processes)
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


# ---------------------------------------------------------------------------- report

def report(data: dict) -> str:
    servers = {name: data["servers"][name] for name in SERVERS if "levels" in data["servers"].get(name, {})}
    parts = []
    headers = ["clients", "requests", "errors", "output tok/s", "TTFT p50 s", "TTFT p95 s", "latency p50 s",
               "latency p95 s", "TPOT p50 ms"]
    for name, res in servers.items():
        rows = [[lv["clients"], lv["requests"], lv["errors"], lv["tokens_per_s"], lv.get("ttft_p50_s", "-"),
                 lv.get("ttft_p95_s", "-"), lv.get("latency_p50_s", "-"), lv.get("latency_p95_s", "-"),
                 1000 * lv["tpot_p50_s"] if lv.get("tpot_p50_s") else "-"] for lv in res["levels"]]
        parts.append(f"### {name}\n\n" + table(headers, rows))
    pairs = [(a, b) for a, b in (("ours", "vllm"), ("ours", "before")) if a in servers and b in servers]
    if pairs:
        rows = []
        for lv in servers["ours"]["levels"]:
            row = [lv["clients"]]
            for a_, b_ in pairs:
                other = next((x for x in servers[b_]["levels"] if x["clients"] == lv["clients"]), None)
                for key in ("tokens_per_s", "ttft_p50_s", "latency_p50_s"):
                    ok = other and lv.get(key) and other.get(key)
                    row.append(lv[key] / other[key] if ok else "-")
            rows.append(row)
        heads = ["clients"] + [f"{a_}/{b_} {m}" for a_, b_ in pairs for m in ("tok/s", "TTFT p50", "latency p50")]
        parts.append("### ratios\n\n" + table(heads, rows))
        if data.get("rounds", 1) > 1:
            parts.append("### ratios per round (the two runs side by side in time)\n\n" + paired(servers, pairs))
    scen = [(name, res) for name, res in servers.items() if "short_behind_long" in res]
    if scen:
        rows = []
        for name, res in scen:
            s, d = res["short_behind_long"], res["disconnects"]
            if "error" in s:
                rows.append([name, "short behind long", "-", "-", s["error"]])
            else:
                rows.append([name, f"{s['short_tokens']} behind {s['long_tokens']}", s["alone"]["latency_s"],
                             s["behind_latency_s"], s["ratio"]])
            if "error" in d:
                rows.append([name, "disconnects", "-", "-", d["error"]])
            else:
                rows.append([name, f"{d['probe_tokens']} after {d['clients']} x {d['long_tokens']} disconnected",
                             d["alone"]["latency_s"], d["after_latency_s"], d["ratio"]])
        parts.append("### latency scenarios\n\n" + table(["server", "scenario", "alone s", "with others s",
                                                         "ratio"], rows))
    sampling = data.get("sampling", "greedy")  # JSON of runs from before the option: greedy
    notes = [f"- {data['preset']} preset, {data['dtype']}, prompt {data['prompt_len']} token ids, "
             f"{data['new_tokens']} new tokens per request, sampling {sampling} ({SAMPLING[sampling]}), "
             f"stop tokens ignored; {data['requests']} "
             f"request(s) per client back to back; our servers TP {data['tp']} x {data['omp_threads']} OpenMP "
             f"thread(s); vLLM cores {data['vllm_cores']}."]
    for name, res in servers.items():
        if res.get("prompt_tokens") != data["prompt_len"]:
            notes.append(f"- {name}: prompt counted as {res.get('prompt_tokens')} tokens, not {data['prompt_len']}.")
        if name != "vllm" and "vllm" in servers:
            n = common_prefix(res.get("first_tokens", []), servers["vllm"].get("first_tokens", []))
            notes.append(f"- {name} vs vLLM: first {n} of {data['check_tokens']} greedy tokens identical"
                         + ("" if servers["vllm"].get("first_tokens") else " (vLLM sent no token ids)") + ".")
        for lv in res["levels"]:
            if lv["errors"]:
                notes.append(f"- {name}, {lv['clients']} clients: {lv['errors']} error(s), e.g. {lv['error_samples'][0]}")
            if lv.get("short_replies"):
                notes.append(f"- {name}, {lv['clients']} clients: {lv['short_replies']} reply(ies) not "
                             f"{data['new_tokens']} tokens long.")
    for name, err in data.get("failed", {}).items():
        notes.append(f"- {name}: not measured: {err}")
    return "\n\n".join(parts) + "\n\n" + "\n".join(notes)


def paired(servers: dict[str, dict], pairs: list[tuple[str, str]]) -> str:
    """Per level and pair: the median and range of each round's ratio, and the waiting servers' CPU seconds."""
    rows = []
    for a_, b_ in pairs:
        for lv in servers[a_]["levels"]:
            other = next((x for x in servers[b_]["levels"] if x["clients"] == lv["clients"]), None)
            if other is None or "rounds" not in lv or "rounds" not in other:
                continue
            row = [f"{a_}/{b_}", lv["clients"]]
            for key in ("tokens_per_s", "ttft_p50_s"):
                ratios = [x[key] / y[key] for x, y in zip(lv["rounds"], other["rounds"]) if x.get(key) and y.get(key)]
                row += [statistics.median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}"] if ratios else ["-", "-"]
            idle = [r["idle_cpu_s"] for r in lv["rounds"] + other["rounds"]]
            rows.append([*row, len(lv["rounds"]), max(idle)])
    return table(["pair", "clients", "tok/s ratio, median", "range", "TTFT p50 ratio, median", "range", "rounds",
                  "waiting servers' CPU s, most"], rows)


def plot(data: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib missing (.venv/bin/python -m pip install -r bench/requirements.txt)")
        return None
    fig, (tok_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in SERVERS:
        res = data["servers"].get(name, {})
        lvs = [lv for lv in res.get("levels", []) if lv["requests"]]
        if not lvs:
            continue
        x = [lv["clients"] for lv in lvs]
        tok_ax.plot(x, [lv["tokens_per_s"] for lv in lvs], "o-", label=name)
        ttft_ax.plot(x, [lv["ttft_p50_s"] for lv in lvs], "o-", label=name)
    for ax, label in ((tok_ax, "output tokens/s (all clients)"), (ttft_ax, "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["concurrency"], [str(c) for c in data["concurrency"]])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(f"{data['preset']} preset, {data['dtype']}, prompt {data['prompt_len']}, "
                 f"{data['new_tokens']} new tokens, ours TP {data['tp']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- main

def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", help="older checkout: a folder or a commit (checked out under bench/out/)")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS),
                        help="which to run, in this order (before needs --before)")
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
    prompts = {name: ids if name == "vllm" else text for name in servers}

    data: dict = {"preset": a.preset, "dtype": a.dtype, "sampling": a.sampling, "tp": a.tp, "omp_threads": a.omp_threads,
                  "prompt_len": len(ids), "prompt_ids": ids, "new_tokens": a.new_tokens, "requests": a.requests,
                  "concurrency": a.concurrency, "check_tokens": a.check_tokens, "vllm_cores": a.vllm_cores,
                  "rounds": a.rounds, "ckpt": str(ckpt), "servers": {}, "failed": {}}
    if a.rounds == 1:
        for name in servers:
            try:
                with contextlib.ExitStack() as stack:
                    result, send, server = start(name, a, roots, ids, text, stack)
                    data["servers"][name] = result
                    result["levels"] = levels(name, send, prompts[name], a)
                    if name != "vllm" and not a.skip_scenarios:
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
                if name != "vllm" and not a.skip_scenarios:
                    scenarios(name, server, text, a, result)
    path = write_json(a.out, data)
    print(report(data))
    print(f"raw numbers: {path}")
    print(f"plot: {plot(data, path.with_suffix('.png'))}")

