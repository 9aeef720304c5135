"""The handler's serving metrics on a real TorchServe's Prometheus endpoint (metrics port, /metrics).

The numbers scraped before, during and after a load are checked against what the clients saw:
token counters against the replies' usage, request outcomes against the statuses, one time to
first token per answered request, gauges busy during the load and back to zero after it, the
prefix cache's hits against the cached tokens the replies report.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest


from tests.support.serving_util import TorchServe

MAX_SEQ_LEN = 256
SLOTS = 4
SHARED = "You are a patient guide who answers in short plain sentences about nature and travel. "
SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def server(synthetic_checkpoint, serve):
    with serve(synthetic_checkpoint("llama2"), max_seq_len=MAX_SEQ_LEN, max_batch_size=SLOTS, dtype=None,
               responseTimeout=None, batchSize=10) as ts:
        yield ts


def scrape(server: TorchServe) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics as {(name, labels without Hostname): value}."""
    reply = server.request("GET", "/metrics", port=server.metrics_port, key=None, timeout=30)
    assert reply.status == 200, reply.body[:200]
    samples = {}
    for line in reply.body.decode().splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = frozenset((k, v) for k, v in LABEL.findall(match[2] or "") if k != "Hostname")
            samples[(match[1], labels)] = float(match[3])
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset({"model_name": "llama", **labels}.items())), 0.0)


def metric_types(server: TorchServe) -> dict[str, str]:
    body = server.request("GET", "/metrics", port=server.metrics_port, key=None, timeout=30).body.decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", body, re.M))


def settle(server: TorchServe, check, timeout: float = 20.0) -> dict:
    """The frontend reads metric lines from the worker's stdout asynchronously: scrape until `check` holds."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.3)


def _openai_stream(server: TorchServe, prompt: str, max_tokens: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.inference_port, timeout=120)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        conn.request("POST", "/predictions/llama/1.0/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json",
                              "Authorization": f"Bearer {server.keys()['inference']}"})
        response = conn.getresponse()
        events = [e for e in response.read().decode().split("\n\n") if e]
        assert response.status == 200 and events[-1] == "data: [DONE]"
        return json.loads(events[-2][len("data: "):])["usage"]
    finally:
        conn.close()


def test_metrics_match_what_the_clients_saw(server: TorchServe) -> None:
    before = scrape(server)
    blocks_total = value(before, "llama_kv_cache_blocks_total")
    assert blocks_total >= SLOTS * MAX_SEQ_LEN / 16

    usages: list[dict] = []
    statuses: dict[int, int] = defaultdict(int)
    lock = threading.Lock()
    done = threading.Event()
    peaks = {"running": 0.0, "waiting": 0.0, "blocks": 0.0}

    def watch() -> None:
        while not done.is_set():
            now = scrape(server)
            peaks["running"] = max(peaks["running"], value(now, "llama_running_sequences"))
            peaks["waiting"] = max(peaks["waiting"], value(now, "llama_waiting_sequences"))
            peaks["blocks"] = max(peaks["blocks"], value(now, "llama_kv_cache_blocks_used"))
            time.sleep(0.1)

    def native(i: int) -> None:
        reply = server.predict({"prompt": f"{SHARED}Request {i} about rivers", "max_new_tokens": 20 + 10 * i,
                                "temperature": 0, "ignore_eos": True})
        with lock:
            statuses[reply.status] += 1
            if reply.status == 200:
                usages.append(reply.json()["usage"])

    def streamed(i: int) -> None:
        usage = _openai_stream(server, f"Streamed {i}: tell me about tea", 30 + 5 * i)
        with lock:
            usages.append(usage)
            statuses[200] += 1

    def bad(i: int) -> None:
        reply = server.predict(b'{"prompt": %d}' % i)
        with lock:
            statuses[reply.status] += 1

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    calls = [lambda i=i: native(i) for i in range(6)] + [lambda i=i: streamed(i) for i in range(3)]
    calls += [lambda i=i: bad(i) for i in range(2)]
    started = time.monotonic()
    with ThreadPoolExecutor(len(calls)) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result(timeout=300)
    native(6)  # alone, after the others: its shared prefix is in the cache for certain
    elapsed = time.monotonic() - started
    done.set()
    watcher.join(timeout=30)
    answered = len(usages)
    assert (answered, dict(statuses)) == (10, {200: 10, 400: 2})

    def delta(samples: dict, name: str, **labels: str) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    generated = sum(u["completion_tokens"] for u in usages)
    after = settle(server, lambda s: delta(s, "llama_requests_total", outcome="ok") >= answered
                   and delta(s, "llama_requests_total", outcome="4xx") >= 2
                   and delta(s, "llama_time_to_first_token_seconds_count") >= answered
                   and value(s, "llama_kv_cache_blocks_used") == 0)
    assert delta(after, "llama_requests_total", outcome="ok") == answered
    assert delta(after, "llama_requests_total", outcome="4xx") == 2
    assert delta(after, "llama_requests_total", outcome="failed") == 0
    assert delta(after, "llama_generation_tokens_total") == generated
    assert delta(after, "llama_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta(after, "llama_time_to_first_token_seconds_count") == answered
    assert delta(after, "llama_time_per_output_token_seconds_count") == answered  # every reply has >= 2 tokens
    ttft_sum = delta(after, "llama_time_to_first_token_seconds_sum")
    assert 0 < ttft_sum < answered * elapsed
    tpot_mean = delta(after, "llama_time_per_output_token_seconds_sum") / answered
    assert 0 < tpot_mean < elapsed
    assert (value(after, "llama_running_sequences"), value(after, "llama_waiting_sequences"),
            value(after, "llama_kv_cache_blocks_used")) == (0, 0, 0)
    assert peaks["blocks"] >= 2 and peaks["running"] >= 1, peaks  # seen busy during the load
    assert peaks["blocks"] <= blocks_total
    cached = [u.get("cached_prompt_tokens", u.get("prompt_tokens_details", {}).get("cached_tokens")) for u in usages]
    assert cached[-1] >= len(SHARED) // 8  # the last request's shared prefix came from the cache
    assert delta(after, "llama_prefix_cache_hits_tokens_total") == sum(cached)
    assert delta(after, "llama_prefix_cache_queries_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta(after, "llama_preemptions_total") == 0
    types = metric_types(server)
    for name in ("llama_time_to_first_token_seconds", "llama_time_per_output_token_seconds"):
        assert types.get(name) == "histogram", (name, types.get(name))
    for name in ("llama_prompt_tokens_total", "llama_generation_tokens_total", "llama_requests_total",
                 "llama_prefix_cache_hits_tokens_total", "llama_prefix_cache_queries_tokens_total",
                 "llama_preemptions_total"):
        assert types.get(name) == "counter", (name, types.get(name))
    for name in ("llama_running_sequences", "llama_waiting_sequences", "llama_kv_cache_blocks_used",
                 "llama_kv_cache_blocks_total"):
        assert types.get(name) == "gauge", (name, types.get(name))
    print(f"\n{answered} requests, {generated} tokens in {elapsed:.1f} s; peaks during the load {peaks}; "
          f"mean TTFT {ttft_sum / answered * 1000:.0f} ms, mean TPOT {tpot_mean * 1000:.1f} ms")


def test_a_disconnected_client_counts_as_cancelled(server: TorchServe) -> None:
    before = scrape(server)
    seen = len(server.finishes())
    conn = http.client.HTTPConnection("127.0.0.1", server.inference_port, timeout=60)
    conn.request("POST", "/predictions/llama", body=json.dumps({"prompt": "go on", "max_new_tokens": 200,
                                                                 "temperature": 0, "ignore_eos": True,
                                                                 "stream": True}).encode(),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {server.keys()['inference']}"})
    response = conn.getresponse()
    assert response.status == 200
    response.readline()
    conn.close()
    cancelled: list[dict] = []
    probes = 0  # each answered in full: counted by the replies, since the log's finish lines trail them
    deadline = time.monotonic() + 30
    while not cancelled and time.monotonic() < deadline:
        assert server.predict({"prompt": "hi", "max_new_tokens": 2, "temperature": 0,
                               "ignore_eos": True}).status == 200  # the handler hears of it on its next call
        probes += 1
        cancelled = [e for e in server.finishes()[seen:] if "disconnected" in e["how"]]
    assert cancelled, "the disconnected request was never cancelled"

    def delta(samples: dict, name: str, **labels: str) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    tokens = cancelled[0]["tokens"] + 2 * probes
    # The frontend takes in each metric line on its own: wait for the token count too.
    after = settle(server, lambda s: delta(s, "llama_requests_total", outcome="cancelled") >= 1
                   and delta(s, "llama_requests_total", outcome="ok") >= probes
                   and delta(s, "llama_generation_tokens_total") >= tokens)
    assert delta(after, "llama_requests_total", outcome="cancelled") == 1
    assert delta(after, "llama_requests_total", outcome="ok") == probes
    assert delta(after, "llama_generation_tokens_total") == tokens
