"""What LoRA adapters cost a decode step: rows on the base against rows each on its own adapter.

    python -m bench.engine.lora_step [--preset llama3.2-1b] [--rows 1 8] [--rounds 3]

The offline engine (TP 1, every core) loads the checkpoint with 8 adapters of rank 16 on all seven
projections (bench/lib/lora_adapters.py, the served benchmark's files), once in bfloat16 and once
quantized int4 at load. A case generates `rows` sequences of an 8-token prompt, on the base or row
i on adapter i; a decode step's time is that of 33 new tokens less that of 1, over 32. The cases
take turns, `--rounds` times; the table gives each case's median and the adapters / base ratio of
each round. Served TPOT (bench.serving.serve --scenario lora) also counts the other clients'
prompt steps; this isolates the decode steps the adapters' kernels run in.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import machine, table
from bench.lib.llamacpp import cpu_flags
from bench.lib.lora_adapters import ensure_adapters
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.sequence import Sequence

ADAPTERS, RANK, PROMPT = 8, 16, [128000, 791, 4320, 315, 279, 1917, 374, 220]


def seconds(engine: Engine, rows: int, adapters: list[str | None], new: int) -> float:
    """Wall seconds of generating `new` tokens for `rows` sequences, row i on adapters[i % len(adapters)]."""
    params = SamplingParams(new, ignore_eos=True)
    seqs = [Sequence(f"r{i}", PROMPT, params, adapter=adapters[i % len(adapters)]) for i in range(rows)]
    started = time.perf_counter()
    engine.generate(seqs)
    return time.perf_counter() - started


def step_ms(engine: Engine, rows: int, adapters: list[str | None]) -> float:
    return (seconds(engine, rows, adapters, 33) - seconds(engine, rows, adapters, 1)) / 32 * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args(argv)
    ckpt = ensure_checkpoint(PRESETS[a.preset], mp=1)
    folders = {f"adapter{i}": str(path) for i, path in enumerate(ensure_adapters(ckpt, ADAPTERS, RANK))}
    engines = {quantize: Engine.load(EngineConfig(str(ckpt), dtype="bfloat16", quantize=quantize, max_seq_len=64,
                                                  max_batch_size=max(a.rows), prefix_caching=False,
                                                  lora_adapters=folders, max_loras=ADAPTERS, max_lora_rank=RANK))
               for quantize in ("none", "int4")}
    cases = [(quantize, rows, on) for quantize in engines for rows in a.rows for on in ("base", "adapters")]
    times: dict[tuple, list[float]] = {case: [] for case in cases}
    for engine in engines.values():  # warm-up: every adapter's slot and every step size once
        step_ms(engine, max(a.rows), list(folders))
    for _ in range(a.rounds):
        for case in cases:
            quantize, rows, on = case
            times[case].append(step_ms(engines[quantize], rows, [None] if on == "base" else list(folders)))
    print(f"{machine()['cpu']}, flags {' '.join(cpu_flags())}; {a.preset}, {ADAPTERS} adapters of rank "
          f"{RANK}; ms a decode step, median of {a.rounds} rounds")
    body = []
    for quantize in engines:
        for rows in a.rows:
            base, adapted = times[(quantize, rows, "base")], times[(quantize, rows, "adapters")]
            ratios = ", ".join(f"{x / b:.2f}" for b, x in zip(base, adapted))
            body.append([quantize, rows, f"{statistics.median(base):.1f}", f"{statistics.median(adapted):.1f}",
                         f"{statistics.median(adapted) / statistics.median(base):.2f}x ({ratios})"])
    print(table(["base", "rows", "on the base", "on adapters (row i on adapter i)", "ratio (per round)"], body))


if __name__ == "__main__":
    main()
