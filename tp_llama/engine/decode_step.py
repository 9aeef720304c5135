"""Decode-only steps at static shapes: what CUDA graphs capture and torch.compile compiles once.

A decode step's rows are padded to the next bucket size (padding rows write into the spare
KV-cache block no sequence owns). Each row carries its token, position, cache index and block
table (padded to max_seq_len's blocks) as device tensors, built on the host and sent in one copy;
the cache is written in place by index and attention reads each row's blocks up to its own length
(Batch.decode_by_index). So one graph per bucket serves every mix of tables and lengths, with no
host sync inside. Which logical block each pool block is, per row (FlexAttention's mask reads
it), is scattered on the device outside the graph: inductor on CPU miscompiles a mask that reads
a tensor computed inside it.
"""

from __future__ import annotations

import torch
from torch import nn

from tp_llama.engine.plan import Row
from tp_llama.model.batch import Batch, cache_index, padded_table, to_device
from tp_llama.model.kv_cache import block_owner

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    return tuple(b for b in BUCKETS if b < max_rows) + (max_rows,)


class DecodeStep:
    """The model's decode-only steps, padded to buckets; compiled (CUDA graphs on CUDA) when asked."""

    def __init__(self, model: nn.Module, max_rows: int, width: int, device: torch.device, compiled: bool):
        self.model, self.device, self.width = model, device, width
        self.sizes = bucket_sizes(max_rows)
        cache = model.layers[0].attention.cache
        self.block_size, self.spare, self.pool_blocks = cache.block_size, cache.spare, cache.pool_blocks
        forward = self._forward
        if compiled:
            for module in model.modules():  # the caches are written in place: keep their addresses
                cache = getattr(module, "cache", None)
                if cache is not None and device.type == "cuda":
                    torch._dynamo.mark_static_address(cache.k)
                    torch._dynamo.mark_static_address(cache.v)
            # One graph per bucket, and dynamo counts every engine's graphs of this function against
            # one limit (8 by default): past it, steps fall back to eager, far slower than captured
            # (checks/gpu_check.py's decode speed).
            torch._dynamo.config.recompile_limit += len(self.sizes)
            torch._dynamo.config.accumulated_recompile_limit += len(self.sizes)
            mode = "reduce-overhead" if device.type == "cuda" else None
            forward = torch.compile(forward, mode=mode, dynamic=False)
        self.forward = forward

    @staticmethod
    def accepts(rows: list[Row]) -> bool:
        """A step of decode rows only, each wanting its next token."""
        return bool(rows) and all(len(row.tokens) == 1 and row.sample for row in rows)

    def __call__(self, rows: list[Row]) -> torch.Tensor:
        """Logits [len(rows), V] (rank 0; [len(rows), 0] elsewhere under TP)."""
        size = next(b for b in self.sizes if b >= len(rows))
        pad, b = size - len(rows), self.block_size
        tables = [padded_table(row.blocks, self.width, self.spare) for row in rows]
        tables += [padded_table([], self.width, self.spare)] * pad
        host = torch.tensor([row.tokens[0] for row in rows] + [0] * pad
                            + [row.start for row in rows] + [0] * pad
                            + [cache_index(row.blocks, row.start, b) for row in rows] + [self.spare * b] * pad
                            + [v for table in tables for v in table], dtype=torch.long)
        tokens, positions, locations, flat = to_device(host, self.device).split([size, size, size, size * self.width])
        tables_t = flat.view(size, self.width)
        owner = block_owner(tables_t, self.pool_blocks)
        return self.forward(tokens, positions, locations, tables_t, owner)[: len(rows)]

    @torch.inference_mode()
    def warm_up(self, sizes: tuple[int, ...] | None = None) -> None:
        """Compile (and capture) the buckets now rather than on the first requests; writes only the spare block."""
        for size in sizes or self.sizes:
            for _ in range(3):  # CUDA graph trees run a graph eagerly, then record it, then replay it
                self([Row(0, [0], True, [self.spare])] * size)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, locations: torch.Tensor, tables: torch.Tensor,
                 owner: torch.Tensor) -> torch.Tensor:
        return self.model(Batch.decode_by_index(tokens, positions, locations, tables, owner, self.block_size))
