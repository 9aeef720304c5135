"""The serving benchmarks' clients: one timed request to our native API or to an OpenAI completions
endpoint (ours or a peer's), and a level of closed-loop clients sending them.

Standard library only: bench/serving/vllm_peer.py imports it, and part of that runs in the vLLM venv.
"""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.support.serving_util import TorchServe

Send = Callable[[list[int] | str, int], dict]  # (prompt, max new tokens) -> one timed streaming reply

SAMPLING = {"greedy": {"temperature": 0}, "default": {"temperature": 0.6, "top_p": 0.9},
            "default-unseeded": {"temperature": 0.6, "top_p": 0.9}}


def sampling_fields(name: str) -> Callable[[], dict]:
    """Each call: the next request's sampling fields (seeded 1, 2, ... for "default": vLLM 0.32's CPU
    engine dies on many seeded requests at once, "CPU Generator does not use offset")."""
    seeds = itertools.count(1)
    return lambda: {**SAMPLING[name], **({"seed": next(seeds)} if name == "default" else {})}


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile: with few samples, an observed value rather than an interpolation."""
    index = max(0, min(len(sorted_values) - 1, round(pct / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def torchserve_stream(server: TorchServe, prompt: str, max_new_tokens: int, timeout: float = 600,
                      disconnect_after_first: bool = False, fields: dict | None = None) -> dict:
    """One request to our native API, streaming unless fields say "stream": False; times in seconds from
    sending (a reply that is not streamed arrives as its one line: its TTFT is its latency).

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


def sse_chunks(response: http.client.HTTPResponse) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream's `data:` lines, up to `data: [DONE]` if it sends one."""
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def post_json(port: int, path: str, body: dict, timeout: float = 60) -> dict:
    """One JSON POST to a local server, its JSON reply; RuntimeError naming the path on another status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"{path}: HTTP {response.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def openai_stream(port: int, path: str, prompt_ids: list[int], max_tokens: int, headers: dict[str, str],
                  extra: dict, timeout: float = 600) -> dict:
    """One streaming OpenAI completions request, greedy, stop tokens ignored; times in seconds from sending.

    Returns ttft_s (first chunk carrying a token), latency_s, tokens (usage.completion_tokens),
    prompt_tokens, cached_tokens (usage.prompt_tokens_details, when sent) and token_ids when the
    server sends them.
    """
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.perf_counter()
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json",
                                                                           **headers})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        first, usage, ids = None, None, []
        for chunk in sse_chunks(response):
            for choice in chunk.get("choices") or []:
                if first is None:
                    first = time.perf_counter() - started
                ids += choice.get("token_ids") or []
            if chunk.get("usage"):
                usage = chunk["usage"]
        latency = time.perf_counter() - started
        if usage is None:
            raise RuntimeError("no usage in the stream")
        return {"ttft_s": first, "latency_s": latency, "tokens": usage["completion_tokens"],
                "prompt_tokens": usage["prompt_tokens"], "token_ids": ids,
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}
    finally:
        conn.close()


def in_threads(count: int, work: Callable[[int, float], None]) -> float:
    """work(client, started) in `count` threads at once, `started` the perf_counter time they all start
    from; the seconds until the last one ends."""
    threads = [threading.Thread(target=lambda c=c: work(c, started), daemon=True) for c in range(count)]
    started = time.perf_counter()  # read by the threads: set before they start
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def run_level(send: Send, prompt: list[int] | str, clients: int, per_client: int, new_tokens: int) -> dict:
    """`clients` threads, each sending `per_client` requests back to back; errors are counted, not raised."""
    replies: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(_: int, started: float) -> None:
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

    wall = in_threads(clients, client)
    level = {"clients": clients, "requests": len(replies), "errors": len(errors), "error_samples": errors[:3],
             "wall_s": wall, "tokens_per_s": sum(r["tokens"] for r in replies) / wall}
    if replies:
        lat = sorted(r["latency_s"] for r in replies)
        ttft = sorted(r["ttft_s"] for r in replies)
        tpot = sorted((r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in replies if r["tokens"] > 1)
        # A reply that ends on its stop token took one decode step more than it has tokens after the first.
        step = sorted((r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1 + (r.get("finish_reason") == "stop"))
                      for r in replies if r["tokens"] > 1)
        level.update({
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
            "tpot_p50_s": percentile(tpot, 50) if tpot else None,
            "step_p50_s": percentile(step, 50) if step else None,
            "short_replies": sum(r["tokens"] != new_tokens for r in replies),
            "prompt_tokens": sorted({r["prompt_tokens"] for r in replies}),
            "timeline": sorted([round(r["sent_s"], 3), round(r["ttft_s"], 3), round(r["latency_s"], 3)]
                               for r in replies),
        })
    return level
