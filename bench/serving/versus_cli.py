"""TorchServe against the offline CLI (`--scenario cli`): 1, 4 and 16 concurrent streaming clients on loopback.

    python -m bench.serving.serve --scenario cli [--preset small] [--tp 2] [--clients 1 4 16]
                                                 [--requests-per-client 2]

Each client sends its requests one after another (greedy, stop tokens ignored, so every reply
has exactly --new-tokens tokens) and times the first streamed chunk (TTFT) and the last one.
Concurrency 1 also runs without streaming, and is compared with the offline CLI
(tp_llama.generate on the same ranks, best of two runs) generating the same prompt: that
difference is what TorchServe, batching delay and HTTP cost per request. The first suite's serving
part (bench/run_all.sh); raw numbers: bench/out/serve.json, which bench.report reads.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import OUT, REPO, last_json, table, torchrun, write_json
from bench.lib.generation import prompt_text
from bench.serving.clients import run_level, torchserve_stream
from bench.serving.servers import NAME, archive, own_rendezvous, start_ready
from tests.support.serving_util import TorchServe


def load_level(server: TorchServe, clients: int, per_client: int, prompt: str, new_tokens: int, stream: bool) -> dict:
    """`clients` threads, each sending `per_client` requests back to back; a failed request fails the run."""
    send = lambda p, n: torchserve_stream(server, p, n, fields={"stream": stream})  # noqa: E731
    level = run_level(send, prompt, clients, per_client, new_tokens)
    if level["errors"]:
        raise RuntimeError(f"{level['errors']} request(s) failed at concurrency {clients}: {level['error_samples'][0]}")
    return {
        "clients": clients, "stream": stream, "requests": level["requests"], "wall_s": level["wall_s"],
        "requests_per_s": level["requests"] / level["wall_s"], "tokens_per_s": level["tokens_per_s"],
        "p50_s": level["latency_p50_s"], "p95_s": level["latency_p95_s"],
        "ttft_p50_s": level["ttft_p50_s"], "ttft_p95_s": level["ttft_p95_s"],
        "prompt_tokens": level["prompt_tokens"][0],
    }


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


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)


def run(a: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    ckpt = ensure_checkpoint(PRESETS[a.preset], mp=a.tp)
    prompt = prompt_text(ckpt, a.prompt_len)
    cli = offline_cli(ckpt, a.tp, prompt, a.new_tokens)
    print(f"offline CLI: {cli['generate_s']:.2f} s to generate {a.new_tokens} tokens", flush=True)

    work = OUT / "serve"
    shutil.rmtree(work, ignore_errors=True)
    store = archive(REPO, ckpt, work / "model_store", a.tp, [own_rendezvous()]).parent
    levels = []
    with TorchServe(work, store, NAME) as server:
        ready_s = start_ready(server, timeout=600)
        print(f"TorchServe ready after {ready_s:.1f} s", flush=True)
        torchserve_stream(server, prompt, 4)
        levels.append(load_level(server, 1, a.requests_per_client, prompt, a.new_tokens, stream=False))
        for clients in a.clients:
            levels.append(load_level(server, clients, a.requests_per_client, prompt, a.new_tokens, stream=True))
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

