"""Where a decode step's time goes: matmuls, attention, norms, C layers and the rest, per engine.

    python -m bench.engine.step [--preset quarter] [--dtypes float32 bfloat16] [--batches 1 8] [--steps 64]
                                [--before COMMIT_OR_PATH] [--rounds 2]

One process, TP 1, the offline engine: for each dtype, engine and batch size, a 128-token prompt
per row, then --steps decode steps. The engines: this checkout's C kernels with a decode step's
layers in one C call (kernels/cpu/decode.c; two per layer under TP), the same kernels called op
by op from Python, and TP_LLAMA_MATMUL=onednn (oneDNN's matmuls and PyTorch's eager layer ops).
With --before, this checkout and the older one (a folder, or a commit checked out under
bench/out/) each run this benchmark in a fresh process, one dtype at a time, taking turns for
--rounds rounds; the table then gives both and the step-time ratio. The
model's matmuls, attention (RoPE, the cache write and softmax(qK)V), RMSNorms and C layer calls are timed by
wrapping the functions that run them; "rest" is the step's time outside them (residual adds,
embedding, the step's Python, sampling). Milliseconds per decode step, medians over the steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import REPO, before_root, module_in, parse_table, run_module, table
from bench.lib.generation import prompts
from tp_llama.backend import cpu, fused
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.kernels.cpu import ops
from tp_llama.model import llama
from tp_llama.parallel import modules

PARTS = ("matmuls", "attention", "norms", "C layers")


class Clock:
    """Seconds spent in each part during the current step."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)

    def timed(self, part: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - started
        return run


def instrument(clock: Clock) -> None:
    """Wrap what each part runs, wherever the serving modules look it up."""
    for module in (fused, cpu, modules):
        module.linear = clock.timed("matmuls", module.linear)
    ops.decode_attention = clock.timed("attention", ops.decode_attention)
    fused.apply_rope = clock.timed("attention", fused.apply_rope)
    fused.attend = clock.timed("attention", fused.attend)
    llama.RMSNorm.forward = clock.timed("norms", llama.RMSNorm.forward)
    cpu.CRMSNorm.forward = clock.timed("norms", cpu.CRMSNorm.forward)
    ops.attention_block = clock.timed("C layers", ops.attention_block)
    ops.ffn_block = clock.timed("C layers", ops.ffn_block)
    ops.decode_stack = clock.timed("C layers", ops.decode_stack)


def measure(engine: Engine, clock: Clock, batch: int, steps: int) -> dict[str, float]:
    """Median ms per decode step of each part (and of the whole step) over `steps` steps."""
    samples: list[dict[str, float]] = []
    last = [0.0]

    def on_step(_) -> None:
        now = time.perf_counter()
        if last[0]:  # the first call ends the prefill step
            samples.append({"step": now - last[0], **clock.spent})
        last[0] = now
        clock.spent = dict.fromkeys(PARTS, 0.0)

    params = SamplingParams(steps + 1, ignore_eos=True)
    engine.generate([Sequence(str(i), p, params) for i, p in enumerate(prompts(engine.args, batch, 128))],
                    on_step=on_step)
    medians = {key: 1e3 * statistics.median(s[key] for s in samples) for key in ("step", *PARTS)}
    medians["rest"] = medians["step"] - sum(medians[p] for p in PARTS)
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quarter")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--before", help="older checkout to run beside this one: a folder or a commit")
    parser.add_argument("--rounds", type=int, default=2, help="with --before: turns each checkout takes per dtype")
    a = parser.parse_args(argv)
    if a.before:
        compare(a, before_root(a.before))
        return
    ckpt = ensure_checkpoint(PRESETS[a.preset], mp=1)
    clock = Clock()
    instrument(clock)
    rows = []
    for dtype in a.dtypes:
        for forced in (None, "onednn"):
            os.environ.pop("TP_LLAMA_MATMUL", None)
            if forced:
                os.environ["TP_LLAMA_MATMUL"] = forced
            engine = Engine.load(EngineConfig(str(ckpt), "tp", dtype, max_seq_len=128 + a.steps + 1,
                                              max_batch_size=max(a.batches),
                                              prefill_budget=128 * max(a.batches)))  # every prompt in one step
            engine.generate([Sequence("warm", prompts(engine.args, 1, 16)[0], SamplingParams(4, ignore_eos=True))])
            in_c = engine.model.layers
            engines = ([("oneDNN + eager", in_c)] if forced
                       else [("C layers", in_c), ("C kernels op by op", llama.Layers(in_c))])
            for batch in a.batches:
                for label, layers in engines:
                    engine.model.layers = layers
                    m = measure(engine, clock, batch, a.steps)
                    rows.append([dtype, batch, label, m["step"], *(m[p] for p in PARTS), m["rest"]])
                    print(f"{dtype} batch {batch} {label}: step {m['step']:.2f} ms", flush=True)
            del engine
    os.environ.pop("TP_LLAMA_MATMUL", None)
    print(table(["dtype", "batch", "engine", "step ms", *(f"{p} ms" for p in PARTS), "rest ms"], rows))
    print(f"\n{a.preset} preset, TP 1, {torch.get_num_threads()} threads; medians over {a.steps} decode steps "
          "after a 128-token prompt per row.")


def compare(a: argparse.Namespace, before: Path) -> None:
    """This checkout and `before`, each running this benchmark in fresh processes, taking turns."""
    args = ["--preset", a.preset, "--batches", *map(str, a.batches), "--steps", str(a.steps)]
    steps: dict[tuple[str, str, str, str], list[float]] = {}
    for dtype in a.dtypes:
        for _ in range(a.rounds):
            for name, root in (("ours", REPO), ("before", before)):
                module = module_in(root, "bench.engine.step", "bench.bench_step")
                stdout = run_module(module, [*args, "--dtypes", dtype], root, timeout=1800)
                for row in parse_table(stdout):
                    key = (row["dtype"], row["batch"], row["engine"], name)
                    steps.setdefault(key, []).append(float(row["step ms"]))
    rows = []
    for (dtype, batch, engine, name), ours in steps.items():
        if name == "ours" and (dtype, batch, engine, "before") in steps:
            old = steps[(dtype, batch, engine, "before")]
            rows.append([dtype, batch, engine, statistics.median(ours), statistics.median(old),
                         statistics.median(ours) / statistics.median(old), " ".join(f"{v:.2f}" for v in ours),
                         " ".join(f"{v:.2f}" for v in old)])
    print(table(["dtype", "batch", "engine", "ours step ms", "before step ms", "ours / before", "ours runs",
                 "before runs"], rows))
    print(f"\n{a.preset} preset, TP 1; before = {before}; medians over {a.rounds} runs each, taking turns.")


if __name__ == "__main__":
    main()
