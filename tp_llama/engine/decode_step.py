"""Decode-only steps at static shapes: what CUDA graphs capture and torch.compile compiles once.

A decode step's rows are padded to the next bucket size (padding rows write into a spare KV-cache
slot no sequence owns). Each row carries its own token, position and cache slot as device
tensors, built on the host and sent in one copy with every slot's length; the cache is written in
place by index and attention reads each slot up to its own length (Batch.decode_by_index). So one
graph per bucket serves every mix of slots and lengths, with no host sync inside. The paged cache
will give rows block-table locations in place of (slot, position) without changing this shape.
"""

from __future__ import annotations

import torch
from torch import nn

from tp_llama.engine.plan import Row
from tp_llama.model.batch import Batch, to_device

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    return tuple(b for b in BUCKETS if b < max_rows) + (max_rows,)


class DecodeStep:
    """The model's decode-only steps, padded to buckets; compiled (CUDA graphs on CUDA) when asked."""

    def __init__(self, model: nn.Module, max_rows: int, device: torch.device, compiled: bool):
        self.model, self.device = model, device
        self.sizes = bucket_sizes(max_rows)
        self.spare = max_rows  # the cache holds max_rows + 1 slots (Transformer.setup_caches)
        forward = self._forward
        if compiled:
            for module in model.modules():  # the caches are written in place: keep their addresses
                cache = getattr(module, "cache", None)
                if cache is not None and device.type == "cuda":
                    torch._dynamo.mark_static_address(cache.k)
                    torch._dynamo.mark_static_address(cache.v)
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
        pad = size - len(rows)
        seen = [-1] * (self.spare + 1)
        seen[self.spare] = 0
        for row in rows:
            seen[row.slot] = row.start
        host = torch.tensor([row.tokens[0] for row in rows] + [0] * pad
                            + [row.start for row in rows] + [0] * pad
                            + [row.slot for row in rows] + [self.spare] * pad + seen, dtype=torch.long)
        tokens, positions, slots, slot_seen = to_device(host, self.device).split([size, size, size, len(seen)])
        return self.forward(tokens, positions, slots, slot_seen)[: len(rows)]

    @torch.inference_mode()
    def warm_up(self, sizes: tuple[int, ...] | None = None) -> None:
        """Compile (and capture) the buckets now rather than on the first requests; writes only the spare slot."""
        for size in sizes or self.sizes:
            for _ in range(3):  # CUDA graph trees run a graph eagerly, then record it, then replay it
                self([Row(self.spare, 0, [0], True)] * size)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 slot_seen: torch.Tensor) -> torch.Tensor:
        return self.model(Batch.decode_by_index(tokens, positions, slots, slot_seen))
