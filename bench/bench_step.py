"""Where a decode step's time goes: matmuls, attention, norms, C layers and the rest, per engine.

    python -m bench.bench_step [--preset quarter] [--dtypes float32 bfloat16] [--batches 1 8] [--steps 64]

One process, TP 1, the offline engine: for each dtype, engine and batch size, a 128-token prompt
per row, then --steps decode steps. The engines: this checkout's C kernels with a decode step's
layers in one C call (cpu_decode.c; two per layer under TP), the same kernels called op by op
from Python, and TP_LLAMA_MATMUL=onednn (oneDNN's matmuls and PyTorch's eager layer ops). The
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

import torch

from bench.bench_generate import prompts
from bench.checkpoint import PRESETS, ensure_checkpoint
from bench.common import table
from tp_llama import kernels, model, parallel
from tp_llama.engine import Engine
from tp_llama.scheduler import SamplingParams, Sequence

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
    """Wrap what each part runs, wherever the model looks it up."""
    model.linear = clock.timed("matmuls", model.linear)
    parallel.linear = clock.timed("matmuls", parallel.linear)
    kernels.decode_attention = clock.timed("attention", kernels.decode_attention)
    model.apply_rope = clock.timed("attention", model.apply_rope)
    model.Attention._attend = clock.timed("attention", model.Attention._attend)
    model.RMSNorm.forward = clock.timed("norms", model.RMSNorm.forward)
    kernels.attention_block = clock.timed("C layers", kernels.attention_block)
    kernels.ffn_block = clock.timed("C layers", kernels.ffn_block)
    kernels.decode_stack = clock.timed("C layers", kernels.decode_stack)


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
    a = parser.parse_args(argv)
    ckpt = ensure_checkpoint(PRESETS[a.preset], mp=1)
    clock = Clock()
    instrument(clock)
    rows = []
    for dtype in a.dtypes:
        for forced in (None, "onednn"):
            os.environ.pop("TP_LLAMA_MATMUL", None)
            if forced:
                os.environ["TP_LLAMA_MATMUL"] = forced
            engine = Engine.load(ckpt, "tp", dtype, max_seq_len=128 + a.steps + 1, max_batch_size=max(a.batches),
                                 prefill_budget=128 * max(a.batches))  # every prompt in one step
            engine.generate([Sequence("warm", prompts(engine.args, 1, 16)[0], SamplingParams(4, ignore_eos=True))])
            planned = engine.model.decode_layers
            engines = [("oneDNN + eager", None)] if forced else [("C layers", planned), ("C kernels op by op", None)]
            for batch in a.batches:
                for label, layers in engines:
                    engine.model.decode_layers = layers
                    m = measure(engine, clock, batch, a.steps)
                    rows.append([dtype, batch, label, m["step"], *(m[p] for p in PARTS), m["rest"]])
                    print(f"{dtype} batch {batch} {label}: step {m['step']:.2f} ms", flush=True)
            del engine
    os.environ.pop("TP_LLAMA_MATMUL", None)
    print(table(["dtype", "batch", "engine", "step ms", *(f"{p} ms" for p in PARTS), "rest ms"], rows))
    print(f"\n{a.preset} preset, TP 1, {torch.get_num_threads()} threads; medians over {a.steps} decode steps "
          "after a 128-token prompt per row.")


if __name__ == "__main__":
    main()
