"""The paged KV cache, and attention of a batch's tokens over it.

The cache is a pool of blocks of `block_size` positions; a sequence's block table says which
blocks hold its positions, so sequences take memory as they grow and share the blocks of a common
prefix (tp_llama.engine.blocks keeps the books on rank 0). Every token's key and value are
written to its cache index first; then decode rows attend together over their blocks (one query
each, a mask for their lengths), and each prompt chunk attends causally over its own.

A batch built on the device (Batch.decode_by_index, the capturable step) reads each row's blocks
only up to its own length through FlexAttention's block mask, with no host data and no padding to
the longest row; compiled, FlexAttention fuses it into one kernel (uncompiled it materialises the
scores, which is only for tests).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from tp_llama.model.batch import Batch


MIN_DECODE_SPLITS = 16  # while a step's rows x KV heads leave multiprocessors without a CTA of their own
FULL_GRID_SPLITS = 4  # once they give every multiprocessor one (bench/gpu_attention.py)


class KVCache:
    """Keys and values [kv_heads, (n_blocks + 1) * block_size, head_dim] (this rank's heads): block b
    holds cache indices b * block_size ..; the last block is the spare that padding rows write to."""

    def __init__(self, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.block_size, self.spare = block_size, n_blocks
        shape = (n_kv_heads, (n_blocks + 1) * block_size, head_dim)
        # Written now, so every page is resident from the start: a cache that does not fit fails
        # at load, and memory stays flat while serving.
        self.k = torch.empty(shape, dtype=dtype, device=device).zero_()
        self.v = torch.empty(shape, dtype=dtype, device=device).zero_()

    @property
    def n_blocks(self) -> int:
        """Blocks sequences may own (the spare not counted)."""
        return self.spare

    @property
    def pool_blocks(self) -> int:
        """Every block, the spare included."""
        return self.spare + 1

    def read(self, tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0 .. length - 1 of each row of block tables [rows, width]:
        [rows, kv_heads, length, hd], copied a whole block at a time."""
        rows, blocks = tables.shape[0], -(-length // self.block_size)
        heads, _, hd = self.k.shape
        wanted = tables[:, :blocks].reshape(-1)
        out = []
        # index_select copies whole blocks: faster than advanced indexing here (bench/engine/step.py)
        for cache in (self.k, self.v):
            picked = cache.view(heads, -1, self.block_size * hd).index_select(1, wanted)
            out.append(picked.view(heads, rows, blocks * self.block_size, hd)[:, :, :length].transpose(0, 1))
        return out[0], out[1]

    def write(self, locations: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, kv_heads, hd] of T tokens, at their cache indices."""
        self.k[:, locations] = k.transpose(0, 1)
        self.v[:, locations] = v.transpose(0, 1)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block dst[i] becomes a copy of block src[i] (block ids, on the cache's device)."""
        heads, _, hd = self.k.shape
        for cache in (self.k, self.v):
            blocks = cache.view(heads, -1, self.block_size * hd)
            blocks.index_copy_(1, dst, blocks.index_select(1, src))


def attend(cache: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, done: int = 0,
           window: int | None = None) -> torch.Tensor:
    """Attention [T, heads, hd] of the batch's tokens from index `done` on (q, k rotated), after
    writing their keys and values to the cache; tokens before `done` were attended elsewhere.

    window: Llama 4's chunked attention: a query at position p sees only keys from p // window * window
    on (its block of `window` absolute positions). The cache keeps every position all the same, so a
    prefix cached for a global layer serves the chunked ones too.
    """
    cache.write(batch.locations[done:], k, v)
    return attend_written(cache, q, k, v, batch, done, window)


def attend_written(cache: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch,
                   done: int = 0, window: int | None = None) -> torch.Tensor:
    """`attend`, for tokens whose keys and values are in the cache already."""
    if not batch.prefill:
        return _decode(cache, q, batch, window)
    out = torch.empty_like(q)
    if batch.n_decode > done:
        out[: batch.n_decode] = _decode(cache, q[: batch.n_decode], batch, window)
    for first, row, start, length in batch.prefill:
        chunk = slice(first - done, first - done + length)
        out[chunk] = attend_chunk(cache, q[chunk], k[chunk], v[chunk], batch, row, start, window)
    return out


def _decode_by_index(cache: KVCache, q: torch.Tensor, batch: Batch, window: int | None = None) -> torch.Tensor:
    """One query per row against the blocks of its table, read to its position (FlexAttention:
    every row a batch entry over the whole pool, its block mask listing only its own blocks).

    The query is scaled here (scale=1 there): inductor's lowering wants a query with a 4-d buffer
    of its own, and a view of the 3-d projection is not one.
    """
    queries = q.unsqueeze(2) * (1 / math.sqrt(q.shape[-1]))
    options = None
    if q.is_cuda:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        options = {"SPLIT_KV": decode_splits(sms, len(q), cache.k.shape[0])}
    out = flex_attention(queries, cache.k.unsqueeze(0), cache.v.unsqueeze(0), scale=1.0, enable_gqa=True,
                         block_mask=batch.block_mask if window is None else batch.window_masks[window],
                         kernel_options=options)
    return out.squeeze(2)


def decode_splits(sms: int, rows: int, kv_heads: int) -> int:
    """How many parallel parts FlexAttention's GPU decoding kernel cuts each row's blocks into, on a GPU
    of `sms` multiprocessors. While rows x KV heads are fewer than the multiprocessors: the kernel's own
    choice (two CTAs per multiprocessor), but at least MIN_DECODE_SPLITS, so that a row's blocks are not
    walked by few CTAs. Once they are as many, FULL_GRID_SPLITS: more parts only add work to merge them
    (bench/gpu_attention.py at 32 rows on an H200)."""
    if rows * kv_heads >= sms:
        return FULL_GRID_SPLITS
    return max(2 * sms // (rows * kv_heads), MIN_DECODE_SPLITS)


def _decode(cache: KVCache, q: torch.Tensor, batch: Batch, window: int | None = None) -> torch.Tensor:
    """One query per decode row against its own blocks, gathered to the longest row and masked."""
    if batch.block_mask is not None:
        return _decode_by_index(cache, q, batch, window)
    mask = batch.decode_mask
    if window is not None:
        first = batch.positions[: batch.n_decode] // window * window
        mask = mask & (torch.arange(mask.shape[-1], device=q.device) >= first.unsqueeze(1)).view(mask.shape)
    keys, values = cache.read(batch.tables[: batch.n_decode], mask.shape[-1])
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
    return out.squeeze(2)


def attend_chunk(cache: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, row: int,
                 start: int, window: int | None = None) -> torch.Tensor:
    """A prompt chunk at positions start.. of row `row`: query i sees keys 0 .. start + i (from its
    window's first position on, with a window). A chunk from position 0 attends over its own keys; a
    later one reads the earlier ones from its blocks."""
    length = q.shape[0]
    queries = q.transpose(0, 1).unsqueeze(0)
    if start == 0 and window is None:
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
    else:
        if start == 0:
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        else:
            keys, values = cache.read(batch.tables[row : row + 1], start + length)
        at = (start + torch.arange(length, device=q.device)).unsqueeze(1)
        key_positions = torch.arange(start + length, device=q.device)
        mask = key_positions <= at
        if window is not None:
            mask &= key_positions >= at // window * window
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)

