"""The time of prompt steps, this checkout against an older one, taking turns.

    python -m bench.engine.prompt_step [--preset llama3.2-1b | --ckpt DIR] [--dtypes float32 bfloat16]
                                       [--steps 200 512 8x64] [--repeats 3] [--rounds 2] [--before COMMIT_OR_PATH]

TP 1, the offline engine, every core. Each step of --steps is prefilled alone in one step (the
prefill budget holds it): N is one prompt of N tokens, BxN is B prompts of N tokens together. A
step's time is the first step's, from generate() to its first token out, best of --repeats. With
--before, each checkout runs this file in a fresh process per dtype, taking turns for --rounds
rounds (the older one imports its own tp_llama: PYTHONPATH), and the table gives both, with the
ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import REPO, before_root, table
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence


def shape(step: str) -> tuple[int, int]:
    """"512" -> (1, 512); "8x64" -> (8, 64)."""
    batch, _, length = step.rpartition("x")
    return int(batch or 1), int(length)


def measure(ckpt: str, dtype: str, steps: list[str], repeats: int) -> dict[str, float]:
    """ms of each step, best of `repeats`."""
    longest = max(b * n for b, n in map(shape, steps))
    engine = Engine.load(EngineConfig(ckpt, "tp", dtype,
                                      max_seq_len=max(n for _, n in map(shape, steps)) + 2,
                                      max_batch_size=max(b for b, _ in map(shape, steps)),
                                      prefill_budget=longest, prefix_caching=False))
    gen = torch.Generator().manual_seed(0)
    times = {}
    for step in steps:
        batch, length = shape(step)
        best = float("inf")
        for _ in range(repeats):
            seqs = [Sequence(f"{step}-{i}", torch.randint(3, 1000, (length,), generator=gen).tolist(),
                             SamplingParams(1, ignore_eos=True)) for i in range(batch)]
            started = time.perf_counter()
            engine.generate(seqs)
            best = min(best, time.perf_counter() - started)
        times[step] = 1e3 * best
    return times


def run(root: Path | None, a: argparse.Namespace, ckpt: Path, dtype: str) -> dict[str, float]:
    """This file in a fresh process on `root`'s tp_llama (this checkout's when None)."""
    env = {**os.environ, "PYTHONPATH": str(root or REPO)}
    args = ["--ckpt", str(ckpt), "--dtypes", dtype, "--steps", *a.steps, "--repeats", str(a.repeats), "--worker"]
    done = subprocess.run([sys.executable, __file__, *args], cwd=root or REPO, env=env, capture_output=True,
                          text=True, timeout=3600, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--steps", nargs="+", default=["200", "512", "8x64"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", help="older checkout to run beside this one: a folder or a commit")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help="a Meta checkpoint folder instead of --preset's (bench/out/smollm2/plain)")
    a = parser.parse_args(argv)
    if a.worker:
        print(json.dumps(measure(a.ckpt, a.dtypes[0], a.steps, a.repeats)))
        return
    before = before_root(a.before) if a.before else None
    ckpt = Path(a.ckpt).resolve() if a.ckpt else ensure_checkpoint(PRESETS[a.preset], mp=1)
    rows = []
    for dtype in a.dtypes:
        runs: dict[str, list[dict[str, float]]] = {"ours": [], "before": []}
        for _ in range(a.rounds):
            runs["ours"].append(run(None, a, ckpt, dtype))
            if before:
                runs["before"].append(run(before, a, ckpt, dtype))
        for step in a.steps:
            ours = statistics.median(r[step] for r in runs["ours"])
            old = statistics.median(r[step] for r in runs["before"]) if before else float("nan")
            rows.append([dtype, step, ours, old, ours / old, " ".join(f"{r[step]:.0f}" for r in runs["ours"]),
                         " ".join(f"{r[step]:.0f}" for r in runs["before"])])
    print(table(["dtype", "step", "ours ms", "before ms", "ours / before", "ours runs", "before runs"], rows))
    print(f"\n{a.ckpt or a.preset + ' preset'}, TP 1, {torch.get_num_threads()} threads; before = {before}; "
          f"medians over {a.rounds} rounds taking turns, each the best of {a.repeats}.")


if __name__ == "__main__":
    main()
