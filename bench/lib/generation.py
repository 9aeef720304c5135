"""What the generation and serving benchmarks share: the prompts they send, and how their greedy
tokens and timings are compared and pooled."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from tp_llama.model import ModelArgs
from tp_llama.testing.tokenizer_train import CORPUS_PATH
from tp_llama.tokenizer import load_tokenizer


def prompts(args: ModelArgs, batch: int, length: int) -> list[list[int]]:
    """Fixed random ids below the special tokens, different for every row."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(3, args.vocab_size - 256, (batch, length), generator=gen).tolist()


def prompt_text(ckpt: Path, tokens: int) -> str:
    """Text from the tokenizer's own corpus that encodes to about `tokens` tokens (BOS included)."""
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    corpus = CORPUS_PATH.read_text()
    return tokenizer.decode(tokenizer.encode(corpus, bos=False)[: tokens - 1])


def common_prefix(x: list[int], y: list[int]) -> int:
    """How many tokens two runs produce alike before they part."""
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def agreement(a: list[list[int]], b: list[list[int]]) -> int:
    """Shortest common prefix over the rows: how long two greedy runs produce the same tokens."""
    return min(common_prefix(x, y) for x, y in zip(a, b))


def pooled(launches: list[dict]) -> dict:
    """One engine's launches merged: medians over every generation of every launch, per batch size."""
    results = []
    for i, first in enumerate(launches[0]["results"]):
        samples = [s for launch in launches for s in launch["results"][i]["samples"]]
        results.append({
            "batch": first["batch"],
            **{key: statistics.median(s[key] for s in samples) for key in samples[0]},
            "samples": samples,
            "tokens": first["tokens"],
        })
    return {"load_s": [launch["load_s"] for launch in launches], "threads": launches[0]["threads"], "results": results}
