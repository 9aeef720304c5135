"""Clients that stress a live TorchServe: the hostile corpus in bursts, and a mixed-client soak.

Used by tests/test_reliability.py (short runs in CI) and bench/serving/soak.py (the long run).
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil
from tests.support.hostile_corpus import Case
from tests.support.serving_util import TorchServe, without_cache

SOAK_PROMPTS = [f"Soak prompt {i}: tell me about {w}" for i, w in enumerate(
    ["rivers", "Köln", "tea", "日本語", "stars", "cats", "a long road", "émigrés", "bridges", "rain"])]


def rank_processes(ts: TorchServe) -> dict[int, psutil.Process]:
    """The worker's rank processes (torchrun children running model_service_worker), by RANK."""
    ranks = {}
    for proc in psutil.Process(ts.process.pid).children(recursive=True):
        try:
            if _is_rank(proc.cmdline()):
                ranks[int(proc.environ()["RANK"])] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
            continue
    return ranks


def _is_rank(cmdline: list[str]) -> bool:
    """`python -u .../ts/model_service_worker.py ...`, not the torchrun command that names it."""
    return len(cmdline) > 2 and cmdline[2].endswith("model_service_worker.py")


def stray_ranks(ts: TorchServe) -> list[int]:
    """Rank processes of this server that are no longer under its torchrun (orphans of a restart)."""
    current = {proc.pid for proc in rank_processes(ts).values()}
    strays = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if _is_rank(cmdline) and str(ts.tmp) in " ".join(cmdline) and proc.pid not in current:
            strays.append(proc.pid)
    return strays


def check_completion(reply: dict, prompt_tokens: int, max_new_tokens: int) -> str | None:
    """Why a 200 reply is not a correct completion, or None when it is."""
    if set(reply) != {"text", "token_ids", "finish_reason", "usage"}:
        return f"unexpected fields {sorted(reply)}"
    usage = reply["usage"]
    if usage["prompt_tokens"] != prompt_tokens:
        return f"prompt_tokens {usage['prompt_tokens']} != {prompt_tokens}"
    if usage["completion_tokens"] != len(reply["token_ids"]) or len(reply["token_ids"]) > max_new_tokens:
        return f"completion of {len(reply['token_ids'])} tokens for max_new_tokens {max_new_tokens}"
    if reply["finish_reason"] not in ("stop", "length"):
        return f"finish_reason {reply['finish_reason']!r}"
    return None


@dataclass
class FuzzReport:
    sent: int = 0
    by_status: Counter = field(default_factory=Counter)
    valid_ok: int = 0
    problems: list[str] = field(default_factory=list)


def run_corpus(ts: TorchServe, cases: list[Case], tokenizer: Any, default_new: int, probe: dict, expected: dict,
               concurrency: int = 8) -> FuzzReport:
    """Send the corpus one category (burst) at a time, several at once; after each burst the
    greedy `probe` request must still get `expected`. Every refusal must be a 4xx with a JSON
    message, except the frontend's bare 413 for bodies over max_request_size."""
    report = FuzzReport()
    bursts: dict[str, list[Case]] = {}
    for case in cases:
        bursts.setdefault(case.category, []).append(case)

    def one(case: Case) -> None:
        try:
            reply = ts.predict(case.body, timeout=120)
        except OSError as exc:
            report.problems.append(f"{case.category}: {case.body[:60]!r}: connection error {exc!r}")
            return
        report.by_status[reply.status] += 1
        if case.valid:
            if reply.status != 200:
                report.problems.append(f"{case.category}: valid {case.body[:60]!r} got {reply.status} {reply.body[:200]!r}")
                return
            wanted = case.payload.get("max_new_tokens") or default_new
            why = check_completion(reply.json(), len(case.prompt_ids(tokenizer)), wanted)
            if why:
                report.problems.append(f"{case.category}: {case.body[:60]!r}: {why}")
            else:
                report.valid_ok += 1
        elif not 400 <= reply.status < 500:
            report.problems.append(f"{case.category}: {case.body[:60]!r} got {reply.status} {reply.body[:200]!r}")
        elif reply.status != 413:  # the frontend's size cap answers a bare 413 before any handler runs
            try:
                message = json.loads(reply.body)
            except ValueError:
                message = None
            if not isinstance(message, dict) or not ({"error", "message"} & set(message)):
                report.problems.append(f"{case.category}: {reply.status} without a JSON message: {reply.body[:100]!r}")

    with ThreadPoolExecutor(concurrency) as pool:
        for category, burst in bursts.items():
            list(pool.map(one, burst))
            report.sent += len(burst)
            reply = ts.predict(probe)
            if reply.status != 200 or without_cache(reply.json()) != without_cache(expected):
                report.problems.append(f"after the {category!r} burst: probe got {reply.status} {reply.body[:200]!r}")
    return report


@dataclass
class SoakReport:
    seconds: float = 0.0
    completed: Counter = field(default_factory=Counter)  # by client kind
    failures: list[str] = field(default_factory=list)
    tokens: int = 0
    rss_mb: dict[int, list[float]] = field(default_factory=dict)  # samples after warm-up, by rank
    kv_blocks_used_at_end: int | None = None

    def rss_band(self, rank: int) -> float:
        """(max - min) / min of the rank's resident memory after warm-up."""
        samples = self.rss_mb[rank]
        return (max(samples) - min(samples)) / min(samples)


def _post(ts: TorchServe, payload: dict, timeout: float) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", ts.inference_port, timeout=timeout)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ts.keys()['inference']}"}
    conn.request("POST", f"/predictions/{ts.name}", body=json.dumps(payload).encode(), headers=headers)
    return conn, conn.getresponse()


def _soak_request(ts: TorchServe, kind: str, payload: dict, expected: dict) -> tuple[str | None, int]:
    """One client request; returns (failure or None, tokens generated)."""
    conn, response = _post(ts, {**payload, "stream": kind != "plain"}, timeout=120)
    try:
        if response.status != 200:
            return f"{kind}: HTTP {response.status} {response.read()[:200]!r}", 0
        if kind == "disconnect":
            response.readline()  # the first chunk, then hang up mid-stream
            return None, 0
        if kind == "plain":
            reply = json.loads(response.read())
            ids, text = reply["token_ids"], reply["text"]
        else:
            chunks = [json.loads(line) for line in response.read().splitlines() if line.strip()]
            ids = [t for c in chunks for t in c["token_ids"]]
            text = "".join(c["text"] for c in chunks)
        if ids != expected["token_ids"] or text != expected["text"]:
            return f"{kind}: reply for {payload['prompt']!r} differs from the same request sent alone", len(ids)
        return None, len(ids)
    finally:
        conn.close()


def run_soak(ts: TorchServe, seconds: float, clients: int, warmup: float, new_tokens: int = 16,
             sample_every: float = 0.5, seed: int = 0) -> SoakReport:
    """Clients cycle plain / streaming / disconnect-mid-stream requests for `seconds`; every
    greedy reply must equal the one the same request got alone, and rank memory is sampled."""
    payloads = [{"prompt": p, "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True} for p in SOAK_PROMPTS]
    expected = []
    for payload in payloads:
        reply = ts.predict(payload)
        if reply.status != 200:
            raise RuntimeError(f"reference request failed: {reply.status} {reply.body[:200]!r}")
        expected.append(reply.json())
    report = SoakReport()
    ranks = rank_processes(ts)
    lock = threading.Lock()
    started = time.monotonic()
    stop = started + seconds

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        kind = ("plain", "stream", "disconnect")[index % 3]
        while time.monotonic() < stop:
            i = rng.randrange(len(payloads))
            try:
                failure, tokens = _soak_request(ts, kind, payloads[i], expected[i])
            except OSError as exc:
                failure, tokens = f"{kind}: connection error {exc!r}", 0
            with lock:
                report.tokens += tokens
                if failure:
                    report.failures.append(failure)
                else:
                    report.completed[kind] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    while time.monotonic() < stop:
        if time.monotonic() - started >= warmup:
            for rank, proc in ranks.items():
                report.rss_mb.setdefault(rank, []).append(proc.memory_info().rss / 2**20)
        time.sleep(sample_every)
    for thread in threads:
        thread.join(timeout=180)
    report.seconds = time.monotonic() - started
    if any(thread.is_alive() for thread in threads):
        report.failures.append("a client was still waiting 180 s after the soak ended")
    # A client that left while nothing else ran is only noticed at the next call: one probe makes it.
    probe = ts.predict({"prompt": "probe", "max_new_tokens": 1})
    ended = ts.finishes()
    # Blocks in use, not sequences: a leaked block outlives its sequence.
    report.kv_blocks_used_at_end = ended[-1]["blocks"] if probe.status == 200 and ended else None
    return report
