"""Where a serving level's time goes: the serving benchmark's closed-loop clients on the offline engine, by
kind of step.

    python -m bench.engine.rounds [--preset llama3.2-1b] [--dtype bfloat16] [--clients 8 32]
                                  [--requests 2] [--prompt-len 200] [--new-tokens 64]

One process, TP 1, no HTTP: each of --clients clients sends --requests requests one after the other
(prompt of --prompt-len random ids, --new-tokens greedy tokens, prefix caching off), the next as
soon as the last ends, as `bench.serving.serve --scenario levels`'s clients do. The table splits the run's steps into prompt-only
steps, mixed steps (prompt chunks beside decode rows) and decode steps, with their count, median
and total seconds, so a level measured through the server can be told apart into prefill compute,
decode's weight passes and what is neither. To compare checkouts, run this file from each in turn
(an older one: copy this file and bench/lib/ into that checkout, at the same paths).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import table
from bench.lib.generation import prompts
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Scheduled, Sequence

KINDS = ("prompt-only", "mixed", "decode")


def kind(step: Scheduled) -> str:
    """Told before the step commits, while a prompt's sequence still counts as prefilling (a prompt's
    one-token last chunk looks like a decode row)."""
    if not step.prompt_tokens:
        return "decode"
    return "mixed" if any(not seq.prefilling for seq in step.sequences) else "prompt-only"


def run(engine: Engine, clients: int, requests: int, prompt_len: int, new_tokens: int) -> list[object]:
    """One level: tokens/s, TTFT p50 and, per kind of step, count / median ms / total s."""
    ids = iter(prompts(engine.args, clients * requests, prompt_len))
    params = SamplingParams(new_tokens, ignore_eos=True)
    steps: dict[str, list[float]] = {k: [] for k in KINDS}
    lead = engine._forward_and_pick

    def timed(scheduled: Scheduled, end: bool):
        times = steps[kind(scheduled)]
        started = time.perf_counter()
        try:
            return lead(scheduled, end)
        finally:
            times.append(time.perf_counter() - started)

    engine._forward_and_pick = timed
    scheduler = engine.new_scheduler()
    issued = 0

    def send() -> Sequence:
        nonlocal issued
        issued += 1
        seq = Sequence(str(issued), next(ids), params)
        scheduler.add(seq)
        return seq

    started = time.perf_counter()
    live = [send() for _ in range(clients)]
    done: list[Sequence] = []
    while live:
        engine.run(scheduler, until_finished=True)
        done += [seq for seq in live if seq.finished]
        live = [seq for seq in live if not seq.finished]
        live += [send() for _ in range(min(clients - len(live), clients * requests - issued))]
    seconds = time.perf_counter() - started
    engine._forward_and_pick = lead
    ttft = statistics.median(seq.first_token_at - seq.arrived for seq in done)
    cells: list[object] = [clients, sum(len(seq.output) for seq in done) / seconds, ttft]
    for k in KINDS:
        cells += [len(steps[k]), 1e3 * statistics.median(steps[k]) if steps[k] else 0, sum(steps[k])]
    return [*cells, seconds]


HEADERS = ["clients", "tok/s", "TTFT p50 s", *(f"{k} {c}" for k in KINDS for c in ("steps", "median ms", "s")),
           "wall s"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-budget", type=int, default=EngineConfig.prefill_budget,
                        help="rows per step, decode rows included (the yaml's engine.prefill_budget)")
    a = parser.parse_args(argv)
    engine = Engine.load(EngineConfig(str(ensure_checkpoint(PRESETS[a.preset], mp=1)), dtype=a.dtype,
                                      prefill_budget=a.prefill_budget, prefix_caching=False))
    engine.generate([Sequence("warm", prompts(engine.args, 1, 16)[0], SamplingParams(4, ignore_eos=True))])
    rows = []
    for clients in a.clients:
        rows.append(run(engine, clients, a.requests, a.prompt_len, a.new_tokens))
        print(f"{clients} clients: {rows[-1][1]:.1f} tok/s", flush=True)
    print(table(HEADERS, rows))
    print(f"\n{a.preset} preset, {a.dtype}, TP 1; {a.requests} requests a client, prompt {a.prompt_len}, "
          f"{a.new_tokens} new tokens, greedy; prefill budget {engine.config.prefill_budget}.")


if __name__ == "__main__":
    main()
