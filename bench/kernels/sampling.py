"""What picking the next tokens costs per decode step, by rows, vocabulary and settings.

    python -m bench.kernels.sampling [--rows 1 16 64] [--vocabs 32000 128256] [--repeats 20]
    python -m bench.kernels.sampling --tables masks [--masked-rows 1 8]   # grammar masks alone

One process, this machine's threads, tp_llama.engine.sampling.sample_rows on float32 logits as
the model returns them: greedy, and the yaml's default (temperature 0.6, top_p 0.9), also with
penalties (repetition 1.1, frequency 0.5, presence 0.3 over a 256-token history) and with
logprobs (5 alternatives). Logits are random (nearly flat: the nucleus holds most of the
vocabulary) or peaked (scaled by 4: a few hundred likely tokens, as a trained model gives).
Milliseconds per step, median of --repeats, and per row.

The masks table: rows under a grammar at Llama 3's 128,256 ids (peaked logits), greedy and seeded
(temperature 0.6, top_p 0.9), each row's bitmask in llguidance's layout allowing one token (a JSON
brace or comma), 1% of the vocabulary scattered, or all but one token (inside a string). Side by
side: the same rows free (no mask), the old way (apply_masks' copy with -inf, then the C sampler),
and the C sampler reading the masks (sample_rows with `allowed`, as the engine calls it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.lib.common import table
from bench.lib.llamacpp import cpu_flags
from tp_llama.engine.sampling import SamplingParams, apply_masks, sample_rows
from tp_llama.kernels.cpu import ffi

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


def median_ms(logits: torch.Tensor, rows: list[Row], repeats: int, pick: Callable[..., object] = sample_rows) -> float:
    pick(logits, rows)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        pick(logits, rows)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


MASKED_VOCAB = 128_256
MASKED_SETTINGS = {"greedy": SamplingParams(1),
                   "seeded t0.6 top_p0.9": SamplingParams(1, temperature=0.6, top_p=0.9, seed=1)}


def bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Bool rows [R, V] as llguidance's int32 [R, ceil(V / 32)]: bit j of word w allows token 32 w + j."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, (vocab + 31) // 32 * 32, dtype=torch.bool)
    padded[:, :vocab] = allowed
    words = (padded.view(rows, -1, 32).long() << torch.arange(32)).sum(-1)
    return words.to(torch.int32)


def masks(rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Each kind of mask for `rows` rows (their one token drawn per row)."""
    ids = torch.arange(MASKED_VOCAB)
    one = ids.unsqueeze(0) == torch.randint(MASKED_VOCAB, (rows, 1), generator=gen)
    return {"one token": bitmask(one), "1% scattered": bitmask(torch.rand(rows, MASKED_VOCAB, generator=gen) < 0.01),
            "all but one": bitmask(~one)}


def masked_table(row_counts: list[int], repeats: int, gen: torch.Generator) -> list[list[object]]:
    """Per rows, setting and mask: ms per step free, the old way, and with the masks in C."""
    out = []
    for n in row_counts:
        logits = torch.randn(n, MASKED_VOCAB, generator=gen) * 4.0
        constrained = list(range(n))
        for name, params in MASKED_SETTINGS.items():
            batch = [Row(params, torch.Generator().manual_seed(r) if params.seed is not None else None)
                     for r in range(n)]
            free = median_ms(logits, batch, repeats)
            for kind, bits in masks(n, gen).items():
                old = median_ms(logits, batch, repeats,
                                lambda x, rows, bits=bits: sample_rows(apply_masks(x, bits, constrained), rows))
                new = median_ms(logits, batch, repeats,
                                lambda x, rows, bits=bits: sample_rows(x, rows, bits, constrained))
                out.append([n, name, kind, free, old, new, old / new])
                print(f"masked {n} rows {name} {kind}: old {old:.3f} ms, in C {new:.3f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tables", nargs="+", choices=["settings", "masks"], default=["settings", "masks"])
    parser.add_argument("--masked-rows", type=int, nargs="+", default=[1, 8], help="constrained rows (masks table)")
    a = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    history = torch.randint(0, 32000, (256,), generator=gen).tolist()
    out = []
    for vocab in a.vocabs if "settings" in a.tables else []:
        for shape in ("random", "peaked"):
            for rows in a.rows:
                logits = torch.randn(rows, vocab, generator=gen) * (4.0 if shape == "peaked" else 1.0)
                for name, params in SETTINGS.items():
                    batch = [Row(params, torch.Generator().manual_seed(r), history[:200], history[200:])
                             for r in range(rows)]
                    ms = median_ms(logits, batch, a.repeats)
                    out.append([vocab, shape, rows, name, ms, ms / rows])
                    print(f"vocab {vocab} {shape} {rows} rows {name}: {ms:.2f} ms", flush=True)
    if out:
        print(table(["vocabulary", "logits", "rows", "settings", "ms per step", "ms per row"], out))
    if "masks" in a.tables:
        masked = masked_table(a.masked_rows, a.repeats, gen)
        print(f"\nGrammar masks at vocabulary {MASKED_VOCAB}, peaked logits, every row constrained (ms per step):")
        print(table(["rows", "settings", "mask", "free", "apply_masks + C", "masks in C", "old / new"], masked))
    print(f"\n{torch.get_num_threads()} threads; draw by {'the C kernel' if ffi.load()[0] else 'PyTorch bisection'}; "
          f"CPU flags: {' '.join(cpu_flags())}; medians of {a.repeats}.")


if __name__ == "__main__":
    main()
