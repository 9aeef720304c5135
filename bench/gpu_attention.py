"""The decode step's attention alone, over KV-block sizes and FlexAttention's split counts.

    python -m bench.gpu_attention [--rows 1 32] [--context 512] [--blocks 16 32 64] [--splits 4 8 16 32]

The step's attention as the engine runs it (tp_llama.model.kv_cache._decode_by_index: one query a row
over its own blocks of a paged pool, the block mask built from the step's tensors), one layer of the
Llama 3 8B shape (32 query heads, 8 KV heads of 128, bfloat16), every row `--context` positions long,
its blocks scattered over a pool twice the size the rows need. Each (block size, rows, splits) is
compiled on its own and timed as 32 calls (the 8B's layers) replayed from one CUDA graph, against
reading each row's keys and values once at the copy bandwidth. "auto" is the split count the engine
picks now (kv_cache.decode_splits). bench/gpu_profile.py shows the attention's share of the whole step.

Needs only PyTorch and a GPU; `--device cpu` runs every configuration uncompiled on a small pool
(the tests' run: the numbers mean nothing there).
"""

from __future__ import annotations

import argparse
import sys

import torch

from checks.gpu_check import copy_bandwidth
from tp_llama.model import kv_cache
from tp_llama.model.batch import Batch, cache_index, padded_table

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 32


def step_inputs(rows: int, context: int, block: int, device: torch.device) -> tuple[kv_cache.KVCache, Batch]:
    """A pool with each row's blocks at random places, and the step's batch of one query a row."""
    per_row = -(-context // block)
    cache = kv_cache.KVCache(2 * rows * per_row, block, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    cache.k.normal_()
    cache.v.normal_()
    order = torch.randperm(cache.n_blocks, generator=torch.Generator().manual_seed(rows))[: rows * per_row].tolist()
    tables = [order[r * per_row:(r + 1) * per_row] for r in range(rows)]
    position = context - 1
    host = torch.tensor([padded_table(t, per_row, cache.spare) for t in tables], dtype=torch.long)
    locations = torch.tensor([cache_index(t, position, block) for t in tables], dtype=torch.long)
    batch = Batch.decode_by_index(torch.zeros(rows, dtype=torch.long, device=device),
                                  torch.full((rows,), position, dtype=torch.long, device=device),
                                  locations.to(device), host.to(device), block, cache.pool_blocks)
    return cache, batch


def layers_ms(cache: kv_cache.KVCache, batch: Batch, rows: int, splits: int | None, compiled: bool) -> float:
    """ms of LAYERS calls at this split count (None: the engine's own choice), replayed from one graph."""
    chosen = kv_cache.decode_splits
    if splits is not None:
        kv_cache.decode_splits = lambda *_: splits
    try:
        torch._dynamo.reset()
        q = torch.randn(rows, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=cache.k.device)
        attend = torch.compile(kv_cache._decode_by_index, dynamic=False) if compiled else kv_cache._decode_by_index
        run = lambda: [attend(cache, q, batch) for _ in range(LAYERS)]  # noqa: E731
        if not q.is_cuda:
            run()
            return 0.0
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 10
    finally:
        kv_cache.decode_splits = chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--splits", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = parser.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no GPU visible to this process", file=sys.stderr)
        return 1
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    bandwidth = copy_bandwidth(device) if a.device == "cuda" else 1e10
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if a.device == "cuda" else 0
    print(f"{name}, torch {torch.__version__}, copy {bandwidth / 1e9:.0f} GB/s; {LAYERS} layers' attention, "
          f"context {a.context}\n")
    print("| KV block | rows | splits | ms (32 layers) | floor ms | of the floor |\n|---|---|---|---|---|---|")
    with torch.inference_mode():
        for block in a.blocks:
            for rows in a.rows:
                cache, batch = step_inputs(rows, a.context, block, device)
                floor = LAYERS * rows * a.context * 2 * KV_HEADS * HEAD_DIM * 2 / bandwidth * 1e3
                for splits in [None, *a.splits]:
                    label = (f"auto ({kv_cache.decode_splits(sms, rows, KV_HEADS)})"
                             if splits is None and a.device == "cuda" else splits or "auto")
                    try:
                        ms = layers_ms(cache, batch, rows, splits, compiled=a.device == "cuda")
                    except Exception as exc:  # one configuration FlexAttention refuses: say so, go on
                        print(f"| {block} | {rows} | {label} | {type(exc).__name__}: {str(exc)[:80]} | | |")
                        continue
                    share = f"{floor / ms:.0%}" if ms else "-"
                    print(f"| {block} | {rows} | {label} | {ms:.3f} | {floor:.3f} | {share} |", flush=True)
                del cache, batch
    return 0


if __name__ == "__main__":
    sys.exit(main())
