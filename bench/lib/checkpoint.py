"""Synthetic Meta-layout checkpoints for the benchmarks, written once and kept under bench/out/ckpt.

    python -m bench.lib.checkpoint --preset llama3.2-1b --mp 1

Random weights in Meta's exact layout. "llama3.2-1b" and "llama3.2-3b" have those models' exact
shapes and Meta's real Llama 3 tokenizer.model (128,256 ids, from the llama-models package);
"llama2-7b" has Llama 2 7B's shapes and 32,000-id vocabulary (bfloat16 only: float32 does not
fit 24 GiB), with a small trained tokenizer: drive it by token ids. The small presets keep
quick runs quick: "1b-half" (1B's layers, 8 of 16, vocabulary 4096) for loading, "quarter" and
"small" for generation and serving.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.lib.common import OUT
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
    meta_tokenizer: bool = False  # Meta's real Llama 3 tokenizer.model (vocab_size must be 128256)
    model_vocab: int | None = None  # a model vocabulary larger than its trained tokenizer's


PRESETS = {
    # ~1.0 GB bf16, 503M parameters: loading benchmark.
    "1b-half": Shape(dim=2048, n_layers=8, n_heads=32, n_kv_heads=8, vocab_size=4096),
    # ~0.25 GB bf16 (0.5 GB float32), 126M parameters: generation, still far larger than the L3 cache.
    "quarter": Shape(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=4096),
    # ~36M parameters: serving, where many requests must finish within minutes.
    "small": Shape(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096),
    # The real shapes: 1.24B parameters (2.5 GB bf16), 3.2B (6.4 GB), 6.7B (13.5 GB, bfloat16 only).
    "llama3.2-1b": Shape(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, meta_tokenizer=True),
    "llama3.2-3b": Shape(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.0,
                         meta_tokenizer=True),
    # Llama 3.1 8B's width (ffn 14,336) with 2 and 4 of its 32 layers: step costs fitted per layer and
    # extended to 32 (bench/engine/draft_costs.py), where the whole model would not fit 24 GiB beside its draft.
    "8b-2layers": Shape(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                        ffn_dim_multiplier=1.3, meta_tokenizer=True),
    "8b-4layers": Shape(dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                        ffn_dim_multiplier=1.3, meta_tokenizer=True),
    "llama2-7b": Shape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=4096, ffn_dim_multiplier=None,
                       model_vocab=32000),
}


def meta_llama3_tokenizer() -> Path:
    """Meta's Llama 3 tokenizer.model as llama-models ships it (requirements-test.txt installs it)."""
    import llama_models

    return Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"


def ensure_checkpoint(shape: Shape, mp: int, root: Path = OUT / "ckpt", seed: int = 0) -> Path:
    """The folder for this shape and MP size, written only if it is missing or different.

    Every MP size of one shape holds the same weights (same seed), so loads compare like for like.
    """
    name = f"{shape.family}-d{shape.dim}-l{shape.n_layers}-v{shape.model_vocab or shape.vocab_size}-mp{mp}"
    folder = root / name
    stamp = folder / "bench-shape.json"
    want = json.dumps({**asdict(shape), "mp": mp, "seed": seed}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want:
        return folder
    print(f"writing the {shape} checkpoint (once) to {folder}", flush=True)
    write_checkpoint(
        folder, shape.family, mp, shape.dim, shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.vocab_size,
        shape.multiple_of, shape.ffn_dim_multiplier, torch.bfloat16, seed,
        tokenizer=meta_llama3_tokenizer() if shape.meta_tokenizer else None, model_vocab=shape.model_vocab,
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
