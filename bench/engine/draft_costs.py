"""What speculative decoding with the int4 self-draft costs a step, and the speedup that predicts.

    python -m bench.engine.draft_costs [--preset llama3.2-1b 8b-2layers 8b-4layers] [--tokens 4]
                                       [--acceptance P] [--dtype bfloat16]

For each checkpoint (bench.lib.checkpoint's presets: random weights of the real shapes), the served
model and its int4 self-draft (handler.speculative "draft" without draft_ckpt_dir), TP 1, every
core, the median seconds of a decode step of one row (t1), a verify step of one row carrying k
proposals (tv: k + 1 tokens) and a draft step of one row (td), at position 256. At one client a step
then yields (1 - p^(k+1)) / (1 - p) tokens for a share p of proposals taken (each taken
independently), in k draft steps and a verify step instead of one plain step:

    predicted speedup = tokens a step x t_plain / (t_plain + (tv - t1) + k x td)

where t_plain is a plain token's whole time served (t1 here, the forward alone; the speculative
benchmark puts its measured one). Llama 3.1 8B does not fit 24 GiB beside its draft, so the presets
8b-2layers and 8b-4layers (its width, 2 and 4 layers) are measured and each cost is fitted as
a + b x layers and extended to its 32 layers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import table
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.plan import Row, StepPlan

POSITION = 256


def median_seconds(call, repeats: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def step_costs(engine: Engine, k: int, repeats: int = 30) -> dict[str, float]:
    """t1, tv and td (seconds) of one row at POSITION (or as far as max_seq_len lets it); the engine was
    loaded with its draft and has no sequence running (the rows write into its first blocks)."""
    size, position = engine.config.kv_block_size, min(POSITION, engine.config.max_seq_len - k - 1)
    blocks = list(range(-(-(position + k + 1) // size)))

    def row(tokens: int, proposed: int = 0) -> Row:
        return Row(position, [5] * tokens, True, blocks[: -(-(position + tokens) // size)], proposed=proposed)

    return {
        "t1": median_seconds(lambda: engine._forward(StepPlan([row(1)], end=False)), repeats),
        "tv": median_seconds(lambda: engine._forward(StepPlan([row(k + 1, k)], end=False)), repeats),
        "td": median_seconds(lambda: engine._draft_forward([row(1)]), repeats),
    }


def tokens_a_step(p: float, k: int) -> float:
    """Expected tokens a verify step yields: the proposals taken before the first refused, and one more."""
    return float(k + 1) if p >= 1 else (1 - p ** (k + 1)) / (1 - p)


def predicted_speedup(tokens: float, k: float, t_plain: float, costs: dict[str, float]) -> float:
    return tokens * t_plain / (t_plain + costs["tv"] - costs["t1"] + k * costs["td"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+", default=["llama3.2-1b", "8b-2layers", "8b-4layers"])
    parser.add_argument("--tokens", type=int, default=4, help="proposals a step (k)")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.9],
                        help="shares of proposals taken to predict for (the speculative benchmark measures one)")
    parser.add_argument("--dtype", default="bfloat16")
    a = parser.parse_args(argv)
    measured = {}
    for preset in a.preset:
        folder = ensure_checkpoint(PRESETS[preset], 1)
        engine = Engine.load(EngineConfig(str(folder), "tp", a.dtype, max_seq_len=POSITION + 64, max_batch_size=1,
                                          speculative="draft", kv_cache_memory_gb=0.25))
        measured[preset] = step_costs(engine, a.tokens)
        print(preset, {name: f"{s * 1e3:.2f} ms" for name, s in measured[preset].items()}, flush=True)
        del engine
    if {"8b-2layers", "8b-4layers"} <= set(measured):  # a + b x layers, through both points, at 32 layers
        two, four = measured["8b-2layers"], measured["8b-4layers"]
        measured["llama3.1-8b (fitted)"] = {name: two[name] + (four[name] - two[name]) / 2 * 30 for name in two}
    rows = []
    for name, costs in measured.items():
        speedups = [predicted_speedup(tokens_a_step(p, a.tokens), a.tokens, costs["t1"], costs) for p in a.acceptance]
        rows.append([name, costs["t1"] * 1e3, costs["tv"] * 1e3, costs["td"] * 1e3, costs["td"] / costs["t1"],
                     *speedups])
    print(table(["model", "t1 ms", f"tv ms (k={a.tokens})", "td ms (int4)", "td / t1",
                 *[f"predicted at p={p}" for p in a.acceptance]], rows))
    print(f"\n{a.dtype}, TP 1, {torch.get_num_threads()} threads; one row at position {POSITION}; medians of 30.")


if __name__ == "__main__":
    main()
