"""Write a random-weight checkpoint in Meta's exact consolidated layout.

Tests and the default demo use it; a real Meta download is read the same way.
Usage: python -m tp_llama.synthetic OUT --family llama2|llama3 --mp N [size options]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

from tp_llama.parallel.layout import full_shapes, shard_dim
from tp_llama.checkpoint.params import parse_params
from tp_llama.testing.tokenizer_train import build_tokenizer
from tp_llama.tokenizer import load_tokenizer


def params_json(family: str, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab_size: int,
                multiple_of: int, ffn_dim_multiplier: float | None) -> dict:
    """params.json the way each family writes it (Llama 2: vocab -1, no rope keys)."""
    params: dict = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
                    "multiple_of": multiple_of, "norm_eps": 1e-5}
    if ffn_dim_multiplier is not None:
        params["ffn_dim_multiplier"] = ffn_dim_multiplier
    if family == "llama3":
        params.update(vocab_size=vocab_size, rope_theta=500000.0, use_scaled_rope=True)
    else:
        params["vocab_size"] = -1
    return params


def random_weight(key: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Scaled so activations and logits stay O(1): greedy picks then have clear winners. Made in
    float32 one tensor at a time, so a model of many GB never exists in float32 whole."""
    if len(shape) == 1:
        weight = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    elif key == "tok_embeddings.weight":
        weight = torch.randn(shape, generator=gen)
    else:
        weight = torch.randn(shape, generator=gen).mul_(2.0 / math.sqrt(shape[1]))
    return weight.to(dtype)


def split_for_files(weights: dict[str, torch.Tensor], family: str, mp: int) -> list[dict[str, torch.Tensor]]:
    """Fairscale's split: each file gets 1/mp of every sharded tensor, whole copies of the rest."""
    files: list[dict[str, torch.Tensor]] = [{} for _ in range(mp)]
    for key, tensor in weights.items():
        dim = shard_dim(key, family)
        pieces = [tensor] * mp if dim is None else tensor.chunk(mp, dim=dim)
        for m, piece in enumerate(pieces):
            files[m][key] = piece if mp == 1 else piece.clone()
    return files


def write_checkpoint(
    out: str | Path,
    family: str = "llama2",
    mp: int = 1,
    dim: int = 128,
    n_layers: int = 2,
    n_heads: int = 8,
    n_kv_heads: int = 4,
    vocab_size: int = 512,
    multiple_of: int = 32,
    ffn_dim_multiplier: float | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    tokenizer: str | os.PathLike | None = None,
    model_vocab: int | None = None,
) -> Path:
    """Write params.json, tokenizer.model and consolidated.00..MP-1.pth; returns the folder.

    tokenizer: copy this tokenizer.model (Meta's real Llama 3 one, say) instead of training one.
    model_vocab: a Llama 3 layout's vocabulary when it is to be larger than the tokenizer's (a model
    with Llama 2 7B's 32,000 ids, driven by token ids only).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if family not in ("llama2", "llama3"):
        raise ValueError(f"family must be llama2 or llama3, got {family!r}")
    if mp < 1:
        raise ValueError(f"mp must be >= 1, got {mp}")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.model")
        n_words = load_tokenizer(out / "tokenizer.model").n_words
    else:
        n_words = build_tokenizer(family, out / "tokenizer.model", vocab_size)
    params = params_json(family, dim, n_layers, n_heads, n_kv_heads, model_vocab or n_words, multiple_of,
                         ffn_dim_multiplier)
    args = parse_params(params, out / "params.json", n_words)
    # fairscale splits whole rows: an MP that does not divide them would write files no loader reads.
    sizes = {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "dim": args.dim, "the FFN width": args.ffn_dim,
             "the vocabulary": args.vocab_size}
    if any(size % mp for size in sizes.values()):
        raise ValueError(f"mp {mp} must divide " + ", ".join(f"{name} ({size})" for name, size in sizes.items()))
    (out / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed)
    weights = {key: random_weight(key, shape, gen, dtype) for key, shape in full_shapes(args).items()}
    for m, state in enumerate(split_for_files(weights, family, mp)):
        if family == "llama2":
            state["rope.freqs"] = (1.0 / (10000.0 ** (torch.arange(0, args.head_dim, 2) / args.head_dim))).to(dtype)
        torch.save(state, out / f"consolidated.{m:02d}.pth")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--family", choices=("llama2", "llama3"), default="llama2")
    parser.add_argument("--mp", type=int, default=1, help="number of consolidated files (model-parallel size)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--n-kv-heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=512, help="tokenizer vocabulary (multiple of 8)")
    parser.add_argument("--multiple-of", type=int, default=32)
    parser.add_argument("--ffn-dim-multiplier", type=float, default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    try:
        out = write_checkpoint(
            a.out, a.family, a.mp, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size,
            a.multiple_of, a.ffn_dim_multiplier, getattr(torch, a.dtype), a.seed,
        )
    except (ValueError, RuntimeError) as exc:  # a size the checkpoint cannot have; SentencePiece's vocabulary
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    print(f"wrote {a.family} checkpoint with {a.mp} shard file(s) to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
