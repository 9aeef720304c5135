"""Soak: a real TorchServe with a 2-rank worker under hostile input and minutes of mixed load.

    python -m bench.serving.soak [--minutes 5] [--clients 9]

The long version of tests/test_reliability.py's first two tests. It sends the hostile corpus
(500+ bodies), then runs plain, streaming and disconnect-mid-stream clients for --minutes,
then a corpus from another seed, and reports every figure the README quotes:
statuses, failed valid requests, rank restarts, resident memory drift after warm-up and the
KV-cache blocks still in use at the end. Exits non-zero if any reliability target is missed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

from bench.lib.common import OUT, table, write_json
from tp_llama.testing.synthetic import write_checkpoint
from tp_llama.tokenizer import load_tokenizer

from tests.support.hostile_corpus import hostile_corpus
from deploy.make_archive import build_archive
from tests.support.reliability_util import rank_processes, run_corpus, run_soak, stray_ranks
from tests.support.serving_util import TorchServe

MAX_SEQ_LEN = 256
MAX_BODY = 65536
SERVER_CAP = 262144
DEFAULT_NEW = 8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=9, help="a third each: plain, streaming, disconnecting")
    a = parser.parse_args(argv)

    work = OUT / "soak"
    shutil.rmtree(work, ignore_errors=True)
    ckpt = write_checkpoint(work / "ckpt", family="llama2", mp=2)
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    store = build_archive(ckpt, work / "model_store", overrides=[
        f"handler.max_seq_len={MAX_SEQ_LEN}", f"handler.max_request_bytes={MAX_BODY}",
        f"handler.default_max_new_tokens={DEFAULT_NEW}", "maxBatchDelay=20",
        # replies are compared with the same request sent alone, exactly: float32 (bfloat16's
        # rounding depends on the batch a row runs in)
        "handler.dtype=float32",
    ]).parent
    expiry = int(a.minutes + 30)  # keys must outlive the run
    extra = [f"max_request_size={SERVER_CAP}", f"token_expiration_min={expiry}"]
    probe_payload = {"prompt": "Soak probe", "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    with TorchServe(work, store, "llama", extra_config=extra) as server:
        server.start()
        print(f"TorchServe ready after {server.wait_ready(600):.1f} s", flush=True)
        expected = server.predict(probe_payload).json()

        pids = {p.pid for p in rank_processes(server).values()}
        rounds = []

        def corpus_round(seed: int) -> None:
            cases = hostile_corpus(seed=seed, max_seq_len=MAX_SEQ_LEN, max_body=MAX_BODY, server_cap=SERVER_CAP)
            started = time.monotonic()
            rounds.append((run_corpus(server, cases, tokenizer, DEFAULT_NEW, probe_payload, expected), time.monotonic() - started))
            print(f"hostile corpus: {rounds[-1][0].sent} bodies in {rounds[-1][1]:.1f} s", flush=True)

        corpus_round(seed=100)
        print(f"soak: {a.clients} clients for {a.minutes} min", flush=True)
        soak = run_soak(server, seconds=a.minutes * 60, clients=a.clients, warmup=min(60.0, a.minutes * 15))
        corpus_round(seed=101)
        restarted = {p.pid for p in rank_processes(server).values()} != pids
        strays = stray_ranks(server)

    corpus_rows = [[i + 1, r.sent, f"{t:.1f}", dict(sorted(r.by_status.items())), r.valid_ok, len(r.problems)]
                   for i, (r, t) in enumerate(rounds)]
    print(table(["corpus round", "bodies", "seconds", "statuses", "valid answered 200", "problems"], corpus_rows))
    requests = sum(soak.completed.values())
    rss_rows = [[rank, f"{min(s):.0f}", f"{max(s):.0f}", f"{soak.rss_band(rank):.2%}"]
                for rank, s in sorted(soak.rss_mb.items())]
    print(f"\nsoak: {requests} requests in {soak.seconds:.0f} s ({dict(soak.completed)}), {soak.tokens} tokens, "
          f"{len(soak.failures)} failed, kv blocks used at the end: {soak.kv_blocks_used_at_end}, "
          f"ranks restarted: {restarted}, orphaned ranks: {strays}")
    print(table(["rank", "RSS min MiB (after warm-up)", "RSS max MiB", "band"], rss_rows))
    problems = [p for r, _ in rounds for p in r.problems] + soak.failures
    ok = (not problems and not restarted and not strays and soak.kv_blocks_used_at_end == 0
          and all(soak.rss_band(rank) <= 0.05 for rank in soak.rss_mb))
    write_json("soak", {
        "minutes": a.minutes, "clients": a.clients,
        "corpus": [{"bodies": r.sent, "seconds": t, "statuses": dict(r.by_status), "valid_ok": r.valid_ok,
                    "problems": r.problems} for r, t in rounds],
        "soak": {"seconds": soak.seconds, "completed": dict(soak.completed), "tokens": soak.tokens,
                 "failures": soak.failures, "rss_mb": soak.rss_mb, "kv_blocks_used_at_end": soak.kv_blocks_used_at_end},
        "restarted": restarted, "strays": strays, "ok": ok,
    })
    for problem in problems[:20]:
        print(f"problem: {problem}")
    print("all reliability targets met" if ok else "reliability targets MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
