"""What picking the next tokens costs per decode step, by rows, vocabulary and settings.

    python -m bench.kernels.sampling [--rows 1 16 64] [--vocabs 32000 128256] [--repeats 20]

One process, this machine's threads, tp_llama.engine.sampling.sample_rows on float32 logits as
the model returns them: greedy, and the yaml's default (temperature 0.6, top_p 0.9), also with
penalties (repetition 1.1, frequency 0.5, presence 0.3 over a 256-token history) and with
logprobs (5 alternatives). Logits are random (nearly flat: the nucleus holds most of the
vocabulary) or peaked (scaled by 4: a few hundred likely tokens, as a trained model gives).
Milliseconds per step, median of --repeats, and per row.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from bench.lib.common import table
from tp_llama.engine.sampling import SamplingParams, sample_rows
from tp_llama.kernels.cpu import ffi
from tp_llama.kernels.cpu.build import cpu_flags

SETTINGS = {
    "greedy": SamplingParams(1),
    "t0.6 top_p0.9": SamplingParams(1, temperature=0.6, top_p=0.9),
    "+ penalties": SamplingParams(1, temperature=0.6, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.5,
                                  presence_penalty=0.3),
    "+ logprobs 5": SamplingParams(1, temperature=0.6, top_p=0.9, logprobs=5),
}


@dataclass
class Row:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)


def median_ms(logits: torch.Tensor, rows: list[Row], repeats: int) -> float:
    sample_rows(logits, rows)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sample_rows(logits, rows)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--repeats", type=int, default=20)
    a = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    history = torch.randint(0, 32000, (256,), generator=gen).tolist()
    out = []
    for vocab in a.vocabs:
        for shape in ("random", "peaked"):
            for rows in a.rows:
                logits = torch.randn(rows, vocab, generator=gen) * (4.0 if shape == "peaked" else 1.0)
                for name, params in SETTINGS.items():
                    batch = [Row(params, torch.Generator().manual_seed(r), history[:200], history[200:])
                             for r in range(rows)]
                    ms = median_ms(logits, batch, a.repeats)
                    out.append([vocab, shape, rows, name, ms, ms / rows])
                    print(f"vocab {vocab} {shape} {rows} rows {name}: {ms:.2f} ms", flush=True)
    print(table(["vocabulary", "logits", "rows", "settings", "ms per step", "ms per row"], out))
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2")))
    print(f"\n{torch.get_num_threads()} threads; draw by {'the C kernel' if ffi.load()[0] else 'PyTorch bisection'}; "
          f"CPU flags: {' '.join(flags)}; medians of {a.repeats}.")


if __name__ == "__main__":
    main()
