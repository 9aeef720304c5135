"""Serving benchmark: a real TorchServe on loopback, 1, 4 and 16 concurrent streaming clients.

    python -m bench.bench_serve [--preset small] [--tp 2] [--clients 1 4 16] [--requests-per-client 2]

Each client sends its requests one after another (greedy, stop tokens ignored, so every reply
has exactly --new-tokens tokens) and times the first streamed chunk (TTFT) and the last one.
Concurrency 1 also runs without streaming, and is compared with the offline CLI
(tp_llama.generate on the same ranks, best of two runs) generating the same prompt: that
difference is what TorchServe, batching delay and HTTP cost per request.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import threading
import time
from pathlib import Path

from bench.checkpoint import PRESETS, ensure_checkpoint
from bench.common import OUT, last_json, table, torchrun, write_json
from tp_llama.tokenizer import load_tokenizer

from deploy.make_archive import build_archive
from tests.support.serving_util import TorchServe, free_ports
from tp_llama.testing.tokenizer_train import CORPUS_PATH

NAME = "bench"


def prompt_text(ckpt: Path, tokens: int) -> str:
    """Text from the tokenizer's own corpus that encodes to about `tokens` tokens (BOS included)."""
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    corpus = CORPUS_PATH.read_text()
    return tokenizer.decode(tokenizer.encode(corpus, bos=False)[: tokens - 1])


def one_request(server: TorchServe, payload: dict, key: str) -> dict:
    """POST and read the reply line by line; times are seconds from sending the request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.inference_port, timeout=600)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    started = time.perf_counter()
    try:
        conn.request("POST", f"/predictions/{server.name}", body=json.dumps(payload).encode(), headers=headers)
        response = conn.getresponse()
        first, last_line = None, b""
        for line in response:
            if line.strip():
                first = first if first is not None else time.perf_counter() - started
                last_line = line
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {last_line[:300]!r}")
        usage = json.loads(last_line)["usage"]
        return {"ttft_s": first, "latency_s": time.perf_counter() - started, "tokens": usage["completion_tokens"],
                "prompt_tokens": usage["prompt_tokens"]}
    finally:
        conn.close()


def load_level(server: TorchServe, clients: int, per_client: int, payload: dict) -> dict:
    """`clients` threads, each sending `per_client` requests back to back."""
    key = server.keys()["inference"]
    replies: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client() -> None:
        for _ in range(per_client):
            try:
                reply = one_request(server, payload, key)
            except Exception as exc:  # counted and reported, never silently dropped
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                return
            with lock:
                replies.append(reply)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed at concurrency {clients}: {errors[0]}")
    latencies = sorted(r["latency_s"] for r in replies)
    ttfts = sorted(r["ttft_s"] for r in replies)
    return {
        "clients": clients, "stream": payload["stream"], "requests": len(replies), "wall_s": wall,
        "requests_per_s": len(replies) / wall, "tokens_per_s": sum(r["tokens"] for r in replies) / wall,
        "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
        "prompt_tokens": replies[0]["prompt_tokens"],
    }


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile: with few samples, an observed value rather than an interpolation."""
    index = max(0, min(len(sorted_values) - 1, round(pct / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def offline_cli(ckpt: Path, tp: int, prompt: str, new_tokens: int, runs: int = 2) -> dict:
    """tp_llama.generate on the same ranks, best of `runs`; generation seconds only (load excluded)."""
    args = ["--ckpt-dir", str(ckpt), "--prompt", prompt, "--max-new-tokens", str(new_tokens), "--ignore-eos",
            "--temperature", "0"]
    best = None
    for _ in range(runs):
        reply = last_json(torchrun("tp_llama.generate", args, tp, timeout=600))
        timings, usage = reply["timings"], reply["usage"]
        seconds = (usage["prompt_tokens"] / timings["prefill_tokens_per_s"]
                   + usage["completion_tokens"] / timings["decode_tokens_per_s"])
        if best is None or seconds < best["generate_s"]:
            best = {"generate_s": seconds, "load_s": timings["load_s"], "prompt_tokens": usage["prompt_tokens"],
                    "tokens_per_s": usage["completion_tokens"] / seconds}
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    a = parser.parse_args(argv)

    ckpt = ensure_checkpoint(PRESETS[a.preset], mp=a.tp)
    prompt = prompt_text(ckpt, a.prompt_len)
    payload = {"prompt": prompt, "max_new_tokens": a.new_tokens, "temperature": 0, "ignore_eos": True}
    cli = offline_cli(ckpt, a.tp, prompt, a.new_tokens)
    print(f"offline CLI: {cli['generate_s']:.2f} s to generate {a.new_tokens} tokens", flush=True)

    work = OUT / "serve"
    shutil.rmtree(work, ignore_errors=True)
    # torchrun's c10d rendezvous defaults to port 29400, shared with every other TorchServe
    # worker on the machine: when the one hosting it exits, ours dies too. A port of its own.
    endpoint = f"torchrun.rdzv-endpoint=127.0.0.1:{free_ports(1)[0]}"
    store = build_archive(ckpt, work / "model_store", NAME, a.tp, overrides=[endpoint]).parent
    levels = []
    with TorchServe(work, store, NAME) as server:
        server.start()
        ready_s = server.wait_ready(timeout=600)
        print(f"TorchServe ready after {ready_s:.1f} s", flush=True)
        one_request(server, {**payload, "stream": True, "max_new_tokens": 4}, server.keys()["inference"])
        levels.append(load_level(server, 1, a.requests_per_client, {**payload, "stream": False}))
        for clients in a.clients:
            levels.append(load_level(server, clients, a.requests_per_client, {**payload, "stream": True}))
            print(f"{clients} client(s): {levels[-1]['tokens_per_s']:.1f} tok/s", flush=True)
        stopped = server.stop()

    data = {
        "preset": a.preset, "tp": a.tp, "ckpt": str(ckpt), "prompt_tokens": levels[0]["prompt_tokens"],
        "new_tokens": a.new_tokens, "ready_s": ready_s, "offline_cli": cli, "levels": levels, "stop": stopped,
    }
    path = write_json("serve", data)
    print(report(data))
    print(f"raw numbers: {path}")


def _streaming(data: dict, clients: int) -> dict:
    return next(lv for lv in data["levels"] if lv["clients"] == clients and lv["stream"])


def report(data: dict) -> str:
    """The serving table and the comparison with the offline CLI, from the JSON."""
    single = _streaming(data, 1)
    rows = [[lv["clients"], "yes" if lv["stream"] else "no", lv["requests"], lv["requests_per_s"], lv["tokens_per_s"],
             lv["tokens_per_s"] / single["tokens_per_s"], lv["p50_s"], lv["p95_s"],
             lv["ttft_p50_s"] if lv["stream"] else "-", lv["ttft_p95_s"] if lv["stream"] else "-"]
            for lv in data["levels"]]
    headers = ["clients", "stream", "requests", "req/s", "tokens/s", "x 1 client", "p50 s", "p95 s",
               "TTFT p50 s", "TTFT p95 s"]
    plain, cli = data["levels"][0], data["offline_cli"]
    notes = [
        f"- TP {data['tp']}, prompt {data['prompt_tokens']} tokens, {data['new_tokens']} new tokens per request, "
        f"greedy; TorchServe came up (checkpoint loaded, one warm-up token) in {data['ready_s']:.0f} s.",
        f"- Offline CLI on the same ranks (best of 2 runs): {cli['generate_s']:.2f} s for the same request "
        f"({cli['tokens_per_s']:.1f} tok/s). Through TorchServe at concurrency 1: p50 {plain['p50_s']:.2f} s without "
        f"streaming (x{plain['p50_s'] / cli['generate_s']:.2f}, {plain['p50_s'] - cli['generate_s']:+.2f} s), "
        f"{single['p50_s']:.2f} s streaming (x{single['p50_s'] / cli['generate_s']:.2f}).",
    ]
    return table(headers, rows) + "\n\n" + "\n".join(notes)


def targets(data: dict) -> list[tuple[str, str, bool]]:
    """(target, measured, met): aggregate tokens/s at the highest concurrency vs one client."""
    top = max(lv["clients"] for lv in data["levels"])
    gain = _streaming(data, top)["tokens_per_s"] / _streaming(data, 1)["tokens_per_s"]
    return [(f"serve: {top} clients give at least 4x the tokens/s of one", f"{gain:.2f}x", gain >= 4)]


if __name__ == "__main__":
    main()
