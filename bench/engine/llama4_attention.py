"""Llama 4's attention at Scout's shapes on the C kernels, against PyTorch's masked attention (the path off them).

    python -m bench.engine.llama4_attention [--prompts 512 2048] [--decode 1:1024 8:4096] [--repeats 5]

One RoPE layer (attention within chunks of 8,192 positions) and one NoPE layer (global, its query scaled by
position) of Scout (40 heads, 8 KV heads of 128), bfloat16, random weights, TP 1, every core. Timed: the
attention from the fused q/k/v projection on (iRoPE's steps, the cache write, softmax(qK)V), not the
projections. Prompt rows: one chunk of N tokens from position 0 (C: prompt_attention.c a piece per window).
Decode rows: ROWS:POSITION, each row's keys 0 .. POSITION in its own blocks (C: decode_attention within its
window). The median of --repeats after a warm-up, both paths taking turns in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from bench.engine.moe_step import SCOUT
from bench.lib.common import machine, table
from bench.lib.llamacpp import cpu_flags
from tp_llama.backend.llama4 import ServingAttention
from tp_llama.model.batch import Batch
from tp_llama.model.kv_cache import KVCache
from tp_llama.model.llama import rope_table
from tp_llama.model.llama4 import Llama4Attention

BLOCK = 16
HEADERS = ["layer", "step", "C ms", "PyTorch ms", "PyTorch / C"]


def layer(index: int, positions: int) -> ServingAttention:
    """Scout's attention of layer `index` prepared for the C kernels, with a cache of `positions` positions."""
    torch.manual_seed(index)
    attention = Llama4Attention(dataclasses.replace(SCOUT, moe=None), index).to(torch.bfloat16).requires_grad_(False)
    for weight in attention.parameters():
        weight.normal_(0, weight.shape[-1] ** -0.5)
    attention.cache = KVCache(-(-positions // BLOCK), BLOCK, SCOUT.n_kv_heads, SCOUT.head_dim, torch.bfloat16,
                              torch.device("cpu"))
    return ServingAttention(attention, "tiles")


def median_ms(attention: ServingAttention, batch: Batch, rotation: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(C, PyTorch) median milliseconds of one step's attention."""
    qkv = attention.qkv(torch.randn(len(batch.positions), SCOUT.dim).to(torch.bfloat16))
    times: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(repeats + 1):
        for in_c in (True, False):
            attention.in_c = in_c
            started = time.perf_counter()
            attention.attend(qkv, rotation, batch)
            if repeat:
                times[in_c].append(1000 * (time.perf_counter() - started))
    return statistics.median(times[True]), statistics.median(times[False])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--decode", nargs="+", default=["1:1024", "8:4096"], help="ROWS:POSITION")
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args(argv)
    decode = [tuple(map(int, spec.split(":"))) for spec in a.decode]
    positions = max([*a.prompts, *(rows * -(-(at + 1) // BLOCK) * BLOCK for rows, at in decode)])
    rope = rope_table(SCOUT, positions + BLOCK, torch.device("cpu"))
    out = []
    for index, name in ((0, "RoPE, chunked"), (3, "NoPE, global")):
        attention = layer(index, positions + BLOCK)
        for tokens in a.prompts:
            batch = Batch.build([(0, list(range(tokens)), True, list(range(-(-tokens // BLOCK))))], BLOCK,
                                attention.cache.spare, torch.device("cpu"))
            c, pytorch = median_ms(attention, batch, rope[batch.positions].unsqueeze(1), a.repeats)
            out.append([name, f"prompt of {tokens}", c, pytorch, pytorch / c])
        for rows, at in decode:
            per_row = -(-(at + 1) // BLOCK)
            spec = [(at, [7], True, list(range(r * per_row, (r + 1) * per_row))) for r in range(rows)]
            batch = Batch.build(spec, BLOCK, attention.cache.spare, torch.device("cpu"))
            c, pytorch = median_ms(attention, batch, rope[batch.positions].unsqueeze(1), a.repeats)
            out.append([name, f"{rows} decode rows at {at}", c, pytorch, pytorch / c])
    info = machine()
    print(f"{info['cpu']}, {torch.get_num_threads()} threads, flags {' '.join(cpu_flags())}")
    print(table(HEADERS, out))


if __name__ == "__main__":
    main()
