"""Meta's int4 format (Llama 3.2 QLoRA / SpinQuant: kernels/meta_int4.py), on the C kernels' int4 tiles as
served and on PyTorch's int4 matmul, against the project's own int4 tiles (`quantize: int4`,
kernels/cpu/quant.c) and bfloat16 tiles, on one decoder layer's matmuls of the Llama 3.2 1B shape (fused
q/k/v, wo, fused w1/w3, w2).

    python -m bench.kernels.meta_int4 [--rows 1 8 32] [--repeats 5] [--group 32] [--lora-rank 16]

For each row count: the time of one pass of x [rows, in] over the layer's four weights, the kinds
taking turns within each repeat, the best of the repeats kept. "meta int4 + LoRA" adds QLoRA's adaptor
(rank --lora-rank), "meta int4" leaves it out, "meta int4 + Hadamard" rotates w2's input (SpinQuant);
"meta int4, PyTorch op" is the format on PyTorch's int4 matmul, as CPUs without the C kernels run it
(bfloat16 inputs, so its weights take their bfloat16 scale pairs: kernels.meta_int4.pack).
Random weights: the values do not change a matmul's time.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.lib.common import table
from tp_llama.kernels import choose, linear, prepare
from tp_llama.kernels.meta_int4 import Int4Weight, pack, pack_tiles

SHAPES = {"wqkv": (3072, 2048), "wo": (2048, 2048), "w13": (16384, 2048), "w2": (2048, 8192)}  # 1B: [out, in]


def meta_weight(out: int, k: int, group: int, lora_rank: int, hadamard: bool, gen: torch.Generator,
                tiles: bool) -> Int4Weight:
    q = torch.randint(-8, 8, (out, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(out, k // group, generator=gen) / 50
    lora = (torch.randn(lora_rank, k, generator=gen) / k**0.5, torch.randn(out, lora_rank, generator=gen) / 4) \
        if lora_rank else (None, None)
    weight = Int4Weight((out, k), group, q, scales, None, *lora, 2.0, hadamard)
    return pack_tiles(weight) if tiles else pack(weight, torch.device("cpu"), bf16=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=16)
    a = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    kind, why = choose(torch.device("cpu"), torch.bfloat16)
    tiles = kind in ("amx", "tiles")
    kinds: dict[str, dict[str, object]] = {
        "meta int4": {n: meta_weight(*s, a.group, 0, False, gen, tiles) for n, s in SHAPES.items()},
        "meta int4 + LoRA": {n: meta_weight(*s, a.group, a.lora_rank, False, gen, tiles) for n, s in SHAPES.items()},
        "meta int4 + Hadamard": {n: meta_weight(*s, a.group, 0, n == "w2", gen, tiles) for n, s in SHAPES.items()},
        "meta int4, PyTorch op": {n: meta_weight(*s, a.group, 0, False, gen, False) for n, s in SHAPES.items()},
    }
    plain = {n: torch.randn(s, generator=gen).bfloat16() / 40 for n, s in SHAPES.items()}
    if kind in ("amx", "tiles"):
        kinds["our int4 tiles"] = {n: prepare(w, kind, bits=4) for n, w in plain.items()}
        kinds["bf16 tiles"] = {n: prepare(w, kind) for n, w in plain.items()}
    best = {(name, rows): float("inf") for name in kinds for rows in a.rows}
    for _ in range(a.repeats):
        for rows in a.rows:
            x = {n: torch.randn(rows, s[1], generator=gen).bfloat16() for n, s in SHAPES.items()}
            for name, weights in kinds.items():
                started = time.perf_counter()
                for n, w in weights.items():
                    linear(x[n], w)
                best[name, rows] = min(best[name, rows], time.perf_counter() - started)
    base = "our int4 tiles" if tiles else "meta int4"  # the yardstick: our plain int4
    header = ["kind", *[f"{r} rows (ms)" for r in a.rows], *[f"/ {base}, {r} rows" for r in a.rows]]
    lines = [[name, *[f"{best[name, r] * 1e3:.2f}" for r in a.rows],
              *[f"{best[name, r] / best[base, r]:.2f}" for r in a.rows]] for name in kinds]
    print(f"matmul kind {kind}{f' ({why})' if why else ''}; {torch.get_num_threads()} threads; "
          f"groups of {a.group}, LoRA rank {a.lora_rank}; one 1B layer's matmuls")
    print(table(header, lines))


if __name__ == "__main__":
    main()
