"""A step plan's trip from rank 0 to the other ranks (encode, broadcast, decode), at max_seq_len values.

    python -m bench.engine.plan_wire [--max-seq-len 2048 32768 131072] [--rows 1 32] [--context 1024] [--steps 50]

Two gloo ranks on this CPU, as TP 2 runs them. The wire is sized at load for max_batch_size (32) rows of
max_seq_len each; each step's rows are decode rows of --context positions. Two wires side by side, taking
turns in one run: the whole block region in the one broadcast ("one wire", as before), and the wire holding
INLINE_BLOCKS block ids with the rest in a second broadcast only when a step has more ("inline + rest",
tp_llama/engine/plan.py). Milliseconds a step on rank 1 (from its first broadcast to the decoded plan), medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.lib.common import table
from bench.lib.llamacpp import cpu_flags
from tests.support.dist_util import free_port
from tp_llama.engine import plan as plan_module
from tp_llama.engine.plan import PlanWire, Row, StepPlan
from tp_llama.engine.runner import ModelRunner
from tp_llama.parallel.distributed import DistInfo

BLOCK, MAX_ROWS = 16, 32


def exchange_ms(wire: PlanWire, plan: StepPlan, rank: int, steps: int) -> float:
    """Median ms of a step's exchange, runner.ModelRunner.exchange itself over this wire."""
    runner = SimpleNamespace(info=DistInfo(rank, 2, rank, torch.device("cpu"), "gloo"), wire=wire)
    times = []
    for _ in range(steps + 3):
        dist.barrier()
        started = time.perf_counter()
        got = ModelRunner.exchange(runner, plan if rank == 0 else None)
        times.append(time.perf_counter() - started)
        assert got == plan
    return statistics.median(times[3:]) * 1e3


def run(rank: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    per_row = -(-args.context // BLOCK)
    for max_seq_len in args.max_seq_len:
        width = -(-max_seq_len // BLOCK)
        for rows in args.rows:
            plan = StepPlan([Row(args.context - 1, [7], True, list(range(r * per_row, (r + 1) * per_row)))
                             for r in range(rows)])
            timed = {}
            for label, inline in (("one wire", MAX_ROWS * width), ("inline + rest", plan_module.INLINE_BLOCKS)):
                saved, plan_module.INLINE_BLOCKS = plan_module.INLINE_BLOCKS, inline
                try:
                    timed[label] = exchange_ms(PlanWire(MAX_ROWS, 4 * MAX_ROWS, MAX_ROWS * width), plan, rank,
                                               args.steps)
                finally:
                    plan_module.INLINE_BLOCKS = saved
            if rank == 1:
                results.put((max_seq_len, rows, timed))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-seq-len", type=int, nargs="+", default=[2048, 32768, 131072])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=1024, help="positions of each row's sequence")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run, args=(rank, port, args, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    found = [results.get(timeout=600) for _ in range(len(args.max_seq_len) * len(args.rows))]
    for proc in procs:
        proc.join(timeout=60)
    print(f"CPU flags: {' '.join(cpu_flags())}; "
          f"2 gloo ranks, {torch.get_num_threads()} threads; rows of {args.context} positions\n")
    print(table(["max_seq_len", "rows", "one wire ms", "inline + rest ms", "one / inline"],
                [[m, r, f"{t['one wire']:.2f}", f"{t['inline + rest']:.2f}", f"{t['one wire'] / t['inline + rest']:.2f}"]
                 for m, r, t in found]))


if __name__ == "__main__":
    main()
