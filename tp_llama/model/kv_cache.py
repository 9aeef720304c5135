"""The KV cache, and attention of a batch's tokens over it.

Every token's key and value are written to its slot and position first; then decode rows attend
together over their slots (one query each, a mask for their lengths), and each prompt chunk
attends causally over its own slot.

A batch built on the device (Batch.decode_by_index, the capturable step) reads each slot only up
to its own length through FlexAttention's block mask, with no host data and no padding to the
longest row; compiled, FlexAttention fuses it into one kernel (uncompiled it materialises the
scores, which is only for tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from tp_llama.model.batch import Batch


class KVCache:
    """Keys and values of every slot [slots, kv_heads, max_seq_len, head_dim] (this rank's heads)."""

    def __init__(self, slots: int, max_seq_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        shape = (slots, n_kv_heads, max_seq_len, head_dim)
        # Written now, so every page is resident from the start: a cache that does not fit fails
        # at load, and memory stays flat while serving.
        self.k = torch.empty(shape, dtype=dtype, device=device).zero_()
        self.v = torch.empty(shape, dtype=dtype, device=device).zero_()

    def write(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, kv_heads, hd] of T tokens, at their slots and positions."""
        self.k[slots, :, positions] = k
        self.v[slots, :, positions] = v


def attend(cache: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, done: int = 0) -> torch.Tensor:
    """Attention [T, heads, hd] of the batch's tokens from index `done` on (q, k rotated), after
    writing their keys and values to the cache; tokens before `done` were attended elsewhere."""
    cache.write(batch.slots[done:], batch.positions[done:], k, v)
    if not batch.prefill:
        return _decode(cache, q, batch)
    if not batch.n_decode and len(batch.prefill) == 1:
        return _prefill(cache, q, *batch.prefill[0][1:])
    out = torch.empty_like(q)
    if batch.n_decode > done:
        out[: batch.n_decode] = _decode(cache, q[: batch.n_decode], batch)
    for first, slot, start, length in batch.prefill:
        first -= done
        out[first : first + length] = _prefill(cache, q[first : first + length], slot, start, length)
    return out


KV_BLOCK = 128  # positions per block of the block mask: a slot is read in whole blocks up to its length


def _decode_by_index(cache: KVCache, q: torch.Tensor, batch: Batch) -> torch.Tensor:
    """One query per row, placed at its slot, against the cache blocks its slot has filled."""
    n_slots, _, kv_len, _ = cache.k.shape
    queries = q.new_zeros((n_slots, q.shape[1], 1, q.shape[2]))
    queries[batch.slots, :, 0] = q
    out = flex_attention(queries, cache.k, cache.v, block_mask=_slot_lengths_mask(batch.slot_seen, kv_len),
                         enable_gqa=True)
    return out[batch.slots, :, 0]


def _slot_lengths_mask(seen: torch.Tensor, kv_len: int) -> BlockMask:
    """Slot b sees keys 0 .. seen[b] (none for -1), built on the device from `seen` alone: the blocks
    below its length whole (no mask evaluated there), the one it ends in through the mask."""
    n_slots, blocks = seen.shape[0], -(-kv_len // KV_BLOCK)
    filled = (seen + 1).view(n_slots, 1, 1)
    full = (filled // KV_BLOCK).to(torch.int32)
    partial = (filled % KV_BLOCK != 0).to(torch.int32)
    order = torch.arange(blocks, dtype=torch.int32, device=seen.device).expand(n_slots, 1, 1, blocks)

    def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx <= seen[b]

    return BlockMask.from_kv_blocks(
        partial, (order + full.unsqueeze(-1)).clamp(max=blocks - 1).contiguous(),
        full_kv_num_blocks=full, full_kv_indices=order.contiguous(),
        BLOCK_SIZE=KV_BLOCK, mask_mod=visible, seq_lengths=(1, kv_len),
    )


def _decode(cache: KVCache, q: torch.Tensor, batch: Batch) -> torch.Tensor:
    """One query per slot of [lo, hi) against that slot's cache; holes get a dummy query."""
    if batch.slot_seen is not None:
        return _decode_by_index(cache, q, batch)
    kv_len = batch.decode_mask.shape[-1]
    keys = cache.k[batch.decode_lo : batch.decode_hi, :, :kv_len]
    values = cache.v[batch.decode_lo : batch.decode_hi, :, :kv_len]
    if batch.decode_rows is None:
        queries = q.unsqueeze(2)
    else:
        queries = q.new_zeros((batch.decode_hi - batch.decode_lo, *q.shape[1:])).unsqueeze(2)
        queries[batch.decode_rows] = q.unsqueeze(2)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.decode_mask, enable_gqa=True)
    out = out.squeeze(2)
    return out if batch.decode_rows is None else out[batch.decode_rows]


def _prefill(cache: KVCache, q: torch.Tensor, slot: int, start: int, length: int) -> torch.Tensor:
    """A prompt chunk at positions start.. of its slot: query i sees keys 0 .. start + i."""
    keys = cache.k[slot : slot + 1, :, : start + length]
    values = cache.v[slot : slot + 1, :, : start + length]
    queries = q.transpose(0, 1).unsqueeze(0)
    if start == 0:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
    else:
        mask = torch.arange(start + length, device=q.device) <= (start + torch.arange(length, device=q.device)).unsqueeze(1)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)
