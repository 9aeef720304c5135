"""Latency with others on the server (ours and an older checkout, in `--scenario levels`), each
against the same request alone:

- short behind long: an 8-token request sent 0.5 s after a 256-token one;
- disconnects: 8 streaming clients start 512-token requests and disconnect after their first chunk;
  0.5 s after the last one has gone, a 16-token request.
"""

from __future__ import annotations

import argparse
import threading
import time

from bench.serving.clients import Send, torchserve_stream
from tests.support.serving_util import TorchServe


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


def scenarios(label: str, server: TorchServe, text: str, a: argparse.Namespace, result: dict) -> None:
    for key, scenario in (("short_behind_long", short_behind_long), ("disconnects", disconnects)):
        try:  # a failed scenario still leaves the levels' numbers
            result[key] = scenario(server, text, a.timeout)
            print(f"[{label}] {key}: x{result[key]['ratio']:.2f}", flush=True)
        except Exception as exc:
            result[key] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            print(f"[{label}] {key} FAILED: {result[key]['error']}", flush=True)
