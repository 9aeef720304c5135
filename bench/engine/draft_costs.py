"""What speculative decoding with the int4 self-draft costs a step, and the speedup that predicts.

    python -m bench.engine.draft_costs [--preset llama3.2-1b 8b-2layers 8b-4layers] [--tokens 4]
                                       [--acceptance P] [--dtype bfloat16]

For each checkpoint (bench.lib.checkpoint's presets: random weights of the real shapes), the served
model and its int4 self-draft (handler.speculative "draft" without draft_ckpt_dir), TP 1, every
core, the median seconds of a decode step of one row (t1), a verify step of one row carrying k
proposals (tv(k): k + 1 tokens, k = 1 .. --tokens) and a draft step of one row (td), at position
256. At one client a step then yields (1 - p^(k+1)) / (1 - p) tokens for a share p of proposals taken
(each taken independently), in k draft steps and a verify step instead of one plain step:

    predicted speedup = tokens a step x t_plain / (t_plain + (tv(k) - t1) + k x td)

where t_plain is a plain token's whole time served (t1 here, the forward alone; the speculative
benchmark puts its measured one); the table gives it at the best k, which the engine's proposal
counts find by measuring (engine/proposal_counts.py). Llama 3.1 8B does not fit 24 GiB beside its draft, so the presets
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


def median_seconds(calls: dict[str, object], repeats: int) -> dict[str, float]:
    """Each call's median seconds, the calls taking turns (this VM's speed drifts between runs of one)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(repeats + 3):  # three rounds of warm-up
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            if round_ >= 3:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def step_costs(engine: Engine, k: int, repeats: int = 30) -> dict:
    """t1, td and tv (a list: k = 1 .. k), seconds, of one row at POSITION (or as far as max_seq_len lets
    it); the engine was loaded with its draft and has no sequence running (the rows write into its
    first blocks)."""
    size, position = engine.config.kv_block_size, min(POSITION, engine.config.max_seq_len - k - 1)
    blocks = list(range(-(-(position + k + 1) // size)))

    def row(tokens: int, proposed: int = 0) -> Row:
        return Row(position, [5] * tokens, True, blocks[: -(-(position + tokens) // size)], proposed=proposed)

    calls = {"t1": lambda: engine._forward(StepPlan([row(1)], end=False)),
             "td": lambda: engine._draft_forward([row(1)])}
    for j in range(1, k + 1):
        calls[j] = lambda j=j: engine._forward(StepPlan([row(j + 1, j)], end=False))
    seconds = median_seconds(calls, repeats)
    return {"t1": seconds["t1"], "td": seconds["td"], "tv": [seconds[j] for j in range(1, k + 1)]}


def tokens_a_step(p: float, k: int) -> float:
    """Expected tokens a verify step yields: the proposals taken before the first refused, and one more."""
    return float(k + 1) if p >= 1 else (1 - p ** (k + 1)) / (1 - p)


def predicted_speedup(tokens: float, k: float, t_plain: float, costs: dict) -> float:
    """k proposals a step on average (the verify step's cost at the nearest whole count)."""
    tv = costs["tv"][min(max(round(k), 1), len(costs["tv"])) - 1]
    return tokens * t_plain / (t_plain + tv - costs["t1"] + k * costs["td"])


def best_speedup(p: float, costs: dict) -> tuple[float, int]:
    """The predicted speedup at the best proposal count for acceptance p, and that count."""
    return max((predicted_speedup(tokens_a_step(p, k), k, costs["t1"], costs), k)
               for k in range(1, len(costs["tv"]) + 1))


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
        print(preset, measured[preset], flush=True)
        del engine
    if {"8b-2layers", "8b-4layers"} <= set(measured):  # a + b x layers, through both points, at 32 layers
        two, four = measured["8b-2layers"], measured["8b-4layers"]
        def at_32(x: float, y: float) -> float:
            return x + (y - x) / 2 * 30

        measured["llama3.1-8b (fitted)"] = {"t1": at_32(two["t1"], four["t1"]), "td": at_32(two["td"], four["td"]),
                                            "tv": [at_32(x, y) for x, y in zip(two["tv"], four["tv"])]}
    rows = []
    for name, costs in measured.items():
        best = [best_speedup(p, costs) for p in a.acceptance]
        rows.append([name, costs["t1"] * 1e3, " / ".join(f"{t * 1e3:.1f}" for t in costs["tv"]), costs["td"] * 1e3,
                     costs["td"] / costs["t1"], *[f"{speedup:.2f}x (k={k})" for speedup, k in best]])
    print(table(["model", "t1 ms", f"tv ms (k=1..{a.tokens})", "td ms (int4)", "td / t1",
                 *[f"predicted at p={p}" for p in a.acceptance]], rows))
    print(f"\n{a.dtype}, TP 1, {torch.get_num_threads()} threads; one row at position {POSITION}; medians of 30.")


if __name__ == "__main__":
    main()
