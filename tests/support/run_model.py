"""Running a model under test on plain [B, S] token tensors, each row in a cache "slot": a fixed
run of blocks of the paged cache, so tests can address sequences by number."""

from __future__ import annotations

import torch
from torch import nn

from tp_llama.model import Batch

BLOCK = 16


def setup_slots(model: nn.Module, slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device,
                n_kv_heads: int | None = None, block_size: int = BLOCK) -> None:
    """A paged cache with room for `slots` sequences of max_seq_len, as slot_rows lays them out."""
    model.setup_caches(max_seq_len, slots * -(-max_seq_len // block_size), block_size, dtype, device, n_kv_heads)


def slot_blocks(model: nn.Module, slot: int, positions: int) -> list[int]:
    """The block table of `positions` positions of slot `slot`: its own run of blocks."""
    cache = model.layers[0].attention.cache
    per_slot = -(-model.rope.shape[0] // cache.block_size)
    return list(range(slot * per_slot, slot * per_slot + -(-positions // cache.block_size)))


def slot_batch(model: nn.Module, rows: list[tuple[int, int, list[int], bool]], device: torch.device | None = None,
               all_logits: bool = False) -> Batch:
    """rows: (slot, start position, tokens, want the logits of its last token), as one Batch."""
    cache = model.layers[0].attention.cache
    spec = [(start, ids, want, slot_blocks(model, slot, start + len(ids))) for slot, start, ids, want in rows]
    device = device or next(model.parameters()).device
    return Batch.build(spec, cache.block_size, cache.spare, device, all_logits=all_logits)


def dense_logits(model: nn.Module, tokens: torch.Tensor, start_pos: torch.Tensor, first_slot: int = 0,
                 last_only: bool = True) -> torch.Tensor:
    """Row b of tokens [B, S] at positions start_pos[b].. in slot first_slot + b, as one Batch.

    Returns logits [B, V] of each row's last position (or [B, S, V] with last_only=False), on the
    host whichever device the model runs on.
    """
    rows = [(first_slot + b, int(start), ids, True) for b, (start, ids) in
            enumerate(zip(start_pos.tolist(), tokens.tolist()))]
    logits = model(slot_batch(model, rows, all_logits=not last_only)).cpu()
    return logits if last_only else logits.view(*tokens.shape, logits.shape[-1])
