"""Reliability of a real TorchServe with a 2-rank tensor-parallel worker.

One server, in this order: a hostile corpus of 500+ bodies, a short mixed-client soak, then
ranks killed mid-request and faults injected (TP_LLAMA_FAULT_FILE) during inference and
during load. Every fault must fail fast, with its cause in the log, and the worker must come
back once the fault is gone. Timings are printed (pytest -s) for the README.
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from pathlib import Path

import pytest


from tests.support.hostile_corpus import hostile_corpus
from tp_llama.testing.faults import fault_env
from tests.support.reliability_util import rank_processes, run_corpus, run_soak, stray_ranks
from tests.support.serving_util import TorchServe, without_cache


MAX_SEQ_LEN = 256
MAX_BODY = 65536
SERVER_CAP = 262144
DEFAULT_NEW = 8
COLLECTIVE_TIMEOUT_S = 10
FAIL_FAST_S = 30  # a fault must end the batch or the load attempt well within this
RECOVER_S = 90  # TorchServe's restart back-off plus a reload
SOAK_S = 20
LONG = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(synthetic_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy: the load-fault test corrupts a shard of it for a while."""
    return Path(shutil.copytree(synthetic_checkpoint("llama2"), tmp_path_factory.mktemp("rel") / "ckpt"))


@pytest.fixture(scope="module")
def server(checkpoint: Path, serve, tmp_path_factory: pytest.TempPathFactory):
    faults = tmp_path_factory.mktemp("faults") / "faults.json"
    env = {**fault_env(faults), "TP_LLAMA_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}
    with serve(checkpoint, max_seq_len=MAX_SEQ_LEN, max_request_bytes=MAX_BODY, default_max_new_tokens=DEFAULT_NEW,
               max_batch_size=8, prefill_budget=None, batchSize=12, env=env, with_testing=True,
               extra_config=[f"max_request_size={SERVER_CAP}"]) as ts:
        ts.fault_file = faults
        yield ts


def greedy(prompt: str, new_tokens: int = 12) -> dict:
    return {"prompt": prompt, "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}


def set_faults(ts: TorchServe, faults: list[dict]) -> None:
    if faults:
        ts.fault_file.write_text(json.dumps(faults))
    else:
        ts.fault_file.unlink(missing_ok=True)


def wait_for_log(ts: TorchServe, text: str, after: int, timeout: float) -> float:
    """Seconds until `text` occurs in the model log more than `after` times."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if ts.model_log().count(text) > after:
            return time.monotonic() - started
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} not logged within {timeout} s\n{ts.log_tail()}")


def wait_recovered(ts: TorchServe, old_pids: set[int], probe: dict, expected: dict) -> float:
    """Seconds until new rank processes answer `probe` with `expected`."""
    started = time.monotonic()
    while time.monotonic() - started < RECOVER_S:
        pids = {p.pid for p in rank_processes(ts).values()}
        if pids and not pids & old_pids:
            try:
                reply = ts.predict(probe, timeout=60)
            except OSError:
                reply = None
            if reply is not None and reply.status == 200:
                assert without_cache(reply.json()) == without_cache(expected)
                recovered = time.monotonic() - started
                _no_strays(ts)
                return recovered
        time.sleep(0.5)
    raise TimeoutError(f"worker not back within {RECOVER_S} s\n{ts.log_tail()}")


def _no_strays(ts: TorchServe, grace: float = 10.0) -> None:
    """Ranks of earlier attempts must be gone, not left as orphans holding the model's memory."""
    deadline = time.monotonic() + grace
    while stray_ranks(ts) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not stray_ranks(ts), f"orphaned rank processes {stray_ranks(ts)}"


@pytest.fixture(scope="module")
def reference(server: TorchServe) -> dict:
    probe = greedy("Reliability probe: the weather in Köln")
    reply = server.predict(probe)
    assert reply.status == 200, reply.body
    return {"probe": probe, "expected": reply.json()}


def test_hostile_corpus_is_refused_without_restarts(server: TorchServe, tokenizer, reference: dict) -> None:
    cases = hostile_corpus(seed=7, max_seq_len=MAX_SEQ_LEN, max_body=MAX_BODY, server_cap=SERVER_CAP)
    pids = {p.pid for p in rank_processes(server).values()}

    started = time.monotonic()
    report = run_corpus(server, cases, tokenizer, DEFAULT_NEW, reference["probe"], reference["expected"])
    elapsed = time.monotonic() - started
    print(f"\nhostile corpus: {report.sent} bodies in {elapsed:.1f} s, statuses {dict(report.by_status)}, "
          f"{report.valid_ok} valid ones answered correctly")
    assert report.sent == len(cases) >= 500
    assert not report.problems, "\n".join(report.problems[:20])
    assert not any(status >= 500 for status in report.by_status)
    assert {p.pid for p in rank_processes(server).values()} == pids, "a rank was restarted"


def test_soak_mixed_clients_memory_flat_and_kv_blocks_released(server: TorchServe) -> None:
    report = run_soak(server, seconds=SOAK_S, clients=6, warmup=SOAK_S / 4)
    bands = {rank: report.rss_band(rank) for rank in report.rss_mb}
    print(f"\nsoak: {dict(report.completed)} requests in {report.seconds:.0f} s, {report.tokens} tokens, "
          f"failures {len(report.failures)}, rss band after warm-up "
          + ", ".join(f"rank {r}: {b:.1%}" for r, b in sorted(bands.items()))
          + f", kv blocks used at end {report.kv_blocks_used_at_end}")
    assert not report.failures, report.failures[:10]
    assert min(report.completed[k] for k in ("plain", "stream", "disconnect")) > 0, report.completed
    assert sorted(bands) == [0, 1]
    assert all(band <= 0.05 for band in bands.values()), bands
    assert report.kv_blocks_used_at_end == 0


def _in_flight(ts: TorchServe, payloads: list[dict],
               begun: threading.Event | None = None) -> tuple[list[threading.Thread], dict]:
    """Each payload sent from a thread of its own; `begun` is set when the first response begins
    (its headers go out with the handler's first answer to it: the request is in the running batch)."""
    outcomes: dict = {}

    def send(i: int) -> None:
        try:
            reply = ts.predict(payloads[i], timeout=150, begun=begun)
            outcomes[i] = (reply.status, reply.body, time.monotonic())
        except (OSError, http.client.HTTPException) as exc:  # a response already begun is cut off
            outcomes[i] = (None, repr(exc).encode(), time.monotonic())

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(payloads))]
    for thread in threads:
        thread.start()
    return threads, outcomes


def _join(threads: list[threading.Thread], outcomes: dict) -> None:
    for thread in threads:
        thread.join(timeout=FAIL_FAST_S + 60)
    assert len(outcomes) == len(threads), "a request hung"


def _is_error(status: int | None, body: bytes) -> bool:
    """A 5xx, or a connection cut: TorchServe begins a continuous-batching reply (200) at the first
    step, so a worker that dies later can only end it by closing the connection."""
    if status is None:
        return True
    return status >= 500 and b"text" not in body


def _expect_errors(threads: list[threading.Thread], outcomes: dict, started: float) -> float:
    """Every in-flight request ends with an error status; returns the slowest end after `started`."""
    _join(threads, outcomes)
    for status, body, _ in outcomes.values():
        assert _is_error(status, body), (status, body[:300])
    return max(ended for _, _, ended in outcomes.values()) - started


@pytest.mark.parametrize("victim", [1, 0])
def test_killed_rank_fails_in_flight_requests_and_the_worker_comes_back(server: TorchServe, reference: dict,
                                                                         victim: int) -> None:
    prompts = [f"Killed-rank request {i}: once upon a time" for i in range(3)]
    alone = [server.predict(greedy(p)).json() for p in prompts]
    assert len({tuple(a["token_ids"]) for a in alone}) == len(prompts), "the prompts must give different texts"
    ranks = rank_processes(server)
    set_faults(server, [{"point": "decode", "kind": "delay", "seconds": 0.05}])  # 200 tokens take 10 s or more
    try:
        begun = threading.Event()
        threads, outcomes = _in_flight(server, [{"prompt": p, **LONG} for p in prompts], begun)
        # a reply has begun: its request is decoding, far from done (a fixed wait could kill the rank
        # before any request reached it on a loaded machine, and then none fails)
        assert begun.wait(timeout=FAIL_FAST_S), "no reply began"
        killed = time.monotonic()
        ranks[victim].kill()
    finally:
        set_faults(server, [])
    _join(threads, outcomes)
    # The batch being decoded fails; a request that was still queued is served by the new worker.
    failed = [ended - killed for status, body, ended in outcomes.values() if _is_error(status, body)]
    assert failed, f"no in-flight request failed: {outcomes}"
    failed_after = max(failed)
    for i, (status, body, _) in outcomes.items():
        if not _is_error(status, body):
            assert status == 200, (status, body[:300])
            served = json.loads(body)["token_ids"]
            assert served[: len(alone[i]["token_ids"])] == alone[i]["token_ids"], "another request's text"
    recovered_after = wait_recovered(server, {p.pid for p in ranks.values()}, reference["probe"], reference["expected"])
    replies = [server.predict(greedy(p)) for p in prompts]
    assert [without_cache(r.json()) for r in replies] == [without_cache(a) for a in alone], \
        "a request got another request's text"
    print(f"\nkilled rank {victim}: in-flight requests failed {failed_after:.1f} s after the kill, "
          f"worker serving again {recovered_after:.1f} s later")
    assert failed_after < FAIL_FAST_S


@pytest.mark.parametrize("kind,rank,cause", [
    ("exception", 1, "injected fault at decode on rank 1"),
    ("hang", 1, "injected fault: hanging at decode on rank 1"),
])
def test_inference_fault_fails_the_batch_fast_and_recovers(server: TorchServe, reference: dict, kind: str, rank: int,
                                                           cause: str) -> None:
    old = {p.pid for p in rank_processes(server).values()}
    seen = server.model_log().count(cause)
    set_faults(server, [{"point": "decode", "kind": kind, "rank": rank}])
    try:
        started = time.monotonic()
        threads, outcomes = _in_flight(server, [{"prompt": "fault victim", **LONG}])
        failed_after = _expect_errors(threads, outcomes, started)
        wait_for_log(server, cause, seen, timeout=10)
    finally:
        set_faults(server, [])
    recovered_after = wait_recovered(server, old, reference["probe"], reference["expected"])
    print(f"\ndecode fault {kind} on rank {rank}: request failed after {failed_after:.1f} s, "
          f"serving again {recovered_after:.1f} s after the fault was removed")
    limit = COLLECTIVE_TIMEOUT_S + FAIL_FAST_S if kind == "hang" else FAIL_FAST_S
    assert failed_after < limit


def _corrupt_rank1_shard(ckpt: Path) -> tuple[Path, bytes]:
    path = ckpt / "consolidated.01.pth"
    original = path.read_bytes()
    path.write_bytes(original[: len(original) // 2])
    return path, original


# One of each way a rank fails at load: raising (a corrupt shard; an injected OOM raises the same way, and
# test_bad_checkpoints.py checks it at the process group), exiting, hanging.
LOAD_FAULTS = [
    ("corrupt shard on rank 1", None, "consolidated.01.pth: cannot be read"),
    ("rank 1 exits", {"point": "load", "kind": "exit", "rank": 1}, "injected fault: process exits at load on rank 1"),
    ("rank 1 hangs", {"point": "load", "kind": "hang", "rank": 1}, "injected fault: hanging at load on rank 1"),
]


def _wait_gone(pids: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(p.is_running() and p.status() != "zombie" for p in pids):
        assert time.monotonic() < deadline, f"ranks {[p.pid for p in pids]} still alive after {timeout} s"
        time.sleep(0.2)


def test_load_faults_fail_fast_and_the_worker_recovers_when_removed(server: TorchServe, checkpoint: Path,
                                                                    reference: dict) -> None:
    """A restart (rank 0 killed) reloads into the first fault, and each failed attempt's own restart
    (TorchServe retries a failed worker, after its back-off) into the next: each attempt must log its
    cause and have every rank gone soon after its restart began, and the attempt after the last fault
    is removed must serve, with no rank of any attempt left over. A fault is swapped for the next as
    soon as its cause is logged (the attempt has read it; the next attempt has not started), so each
    attempt meets the fault it is checked for."""
    ranks = rank_processes(server)
    backup = None
    timings = []

    def arm(index: int) -> None:
        """LOAD_FAULTS[index] in place (a corrupt shard or a fault file), the ones before it removed."""
        nonlocal backup
        if backup is not None:
            backup[0].write_bytes(backup[1])
            backup = None
        fault = LOAD_FAULTS[index][1] if index < len(LOAD_FAULTS) else None
        if index < len(LOAD_FAULTS) and fault is None:
            backup = _corrupt_rank1_shard(checkpoint)
        set_faults(server, [fault] if fault is not None else [])

    try:
        arm(0)
        log = server.model_log()
        ranks[0].kill()  # the restart that follows loads the checkpoint again, into the first fault
        began = time.monotonic()
        for index, (name, _, cause) in enumerate(LOAD_FAULTS):
            limit = FAIL_FAST_S + (COLLECTIVE_TIMEOUT_S if "hang" in name else 0)
            cause_after = wait_for_log(server, cause, log.count(cause), timeout=limit + 30)
            arm(index + 1)
            attempt = list(rank_processes(server).values())
            _wait_gone(attempt, limit)
            gone = time.monotonic()
            log = server.model_log()  # the next cause counts once this attempt is over
            timings.append((name, cause_after, gone - began))
            assert gone - began < limit, f"load fault '{name}': took {gone - began:.1f} s"
            began = gone  # the next attempt's restart begins as this one's ranks are gone
    finally:
        arm(len(LOAD_FAULTS))
    recovered_after = wait_recovered(server, {p.pid for p in ranks.values()}, reference["probe"], reference["expected"])
    for name, cause_after, failed_after in timings:
        print(f"\nload fault '{name}': cause logged {cause_after:.1f} s and every rank of that attempt gone "
              f"{failed_after:.1f} s after its restart began")
    print(f"serving again {recovered_after:.1f} s after the last fault was removed")
