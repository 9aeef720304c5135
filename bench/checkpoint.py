"""Synthetic Meta-layout checkpoints of realistic proportions for the benchmarks, written once.

    python -m bench.checkpoint --preset 1b-half --mp 1 2 4

The default preset has Llama 3.2 1B's layer shapes (dim 2048, 32 heads, 8 KV heads, FFN 8192)
with 8 of its 16 layers: 1.0 GB in bfloat16, so loading and decoding stress memory the way a
real model does while a full benchmark run still fits a 2-core machine. The vocabulary is 4096
because that is about the largest BPE the bundled training corpus yields.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.common import OUT
from tp_llama.testing.synthetic import write_checkpoint


@dataclass(frozen=True)
class Shape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = 1.5
    family: str = "llama3"


PRESETS = {
    # ~1.0 GB bf16, 503M parameters: loading benchmark.
    "1b-half": Shape(dim=2048, n_layers=8, n_heads=32, n_kv_heads=8, vocab_size=4096),
    # ~0.25 GB bf16 (0.5 GB float32), 126M parameters: generation, still far larger than the L3 cache.
    "quarter": Shape(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=4096),
    # ~36M parameters: serving, where many requests must finish within minutes.
    "small": Shape(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096),
}


def ensure_checkpoint(shape: Shape, mp: int, root: Path = OUT / "ckpt", seed: int = 0) -> Path:
    """The folder for this shape and MP size, written only if it is missing or different.

    Every MP size of one shape holds the same weights (same seed), so loads compare like for like.
    """
    name = f"{shape.family}-d{shape.dim}-l{shape.n_layers}-v{shape.vocab_size}-mp{mp}"
    folder = root / name
    stamp = folder / "bench-shape.json"
    want = json.dumps({**asdict(shape), "mp": mp, "seed": seed}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want:
        return folder
    write_checkpoint(
        folder, shape.family, mp, shape.dim, shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.vocab_size,
        shape.multiple_of, shape.ffn_dim_multiplier, torch.bfloat16, seed,
    )
    stamp.write_text(want)
    return folder


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("consolidated.*.pth"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b-half")
    parser.add_argument("--mp", type=int, nargs="+", default=[1])
    a = parser.parse_args(argv)
    for mp in a.mp:
        folder = ensure_checkpoint(PRESETS[a.preset], mp)
        print(f"{folder}: {weight_bytes(folder) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
