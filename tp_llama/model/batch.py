"""The layout of one forward: every row's tokens in one sequence, and where each lands in the paged KV cache."""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask


@dataclass
class Batch:
    """One forward: token t sits at positions[t] of its row's sequence, stored at cache index locations[t].

    The cache is a pool of blocks of `block_size` positions; row r's block table tables[r] lists
    the blocks of its positions 0, B, 2B, ... (padded with the spare block). The first `n_decode`
    tokens are decode rows (one token each, rows 0 .. n_decode - 1 of `tables`); the next `n_verify`
    tokens are rows attended as decode rows are: rows that want logits at several positions (speculative
    decoding's proposals) and rows of decoded tokens (`Row.decoded`); `prefill` lists every row after the
    decode rows as (first token index, row of `tables`, start position, length). Logits come back for the
    tokens at `logits_at` only; token t belongs to row token_rows[t] of `tables`.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    locations: torch.Tensor
    logits_at: torch.Tensor
    tables: torch.Tensor
    block_size: int
    n_decode: int
    decode_len: int  # keys the longest decode row sees (0: no decode rows): decode_mask's width
    prefill: list[tuple[int, int, int, int]]
    block_mask: BlockMask | None = None  # decode_by_index: the blocks each row reads, for every layer
    token_rows: torch.Tensor | None = None  # build: each token's row of `tables`
    n_verify: int = 0
    # LoRA: each token's adapter slot (int32; None: every token on the base), and the tokens of each slot
    # in use but the base's (lora/slots.py).
    adapters: torch.Tensor | None = None
    adapter_groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # decode_by_index: Llama 4's chunked attention, the blocks each row reads for each window size.
    window_masks: dict[int, BlockMask] = field(default_factory=dict)

    @classmethod
    def build(cls, rows: list[tuple[int, list[int], int, list[int]]], block_size: int, spare: int,
              device: torch.device, all_logits: bool = False, adapters: list[int] | None = None,
              decoded: list[bool] | None = None) -> Batch:
        """rows: (start position, tokens, how many of its last tokens want logits (0, 1 or more; a
        bool for 0 or 1), block table); a row of one token decodes. `spare`: the block padding tables
        point at. adapters: each row's LoRA adapter slot (0: the base). decoded: the rows whose tokens
        attend as decode rows though they want fewer than two logits (`Row.decoded`).

        Everything is computed on the host from Python ints and copied to the device at once: no
        device sync in the forward.
        """
        as_decode = [want > 1 or bool(decoded and decoded[i]) for i, (_, _, want, _) in enumerate(rows)]
        order = sorted(range(len(rows)), key=lambda i: 0 if len(rows[i][1]) == 1 else 1 if as_decode[i] else 2)
        width = max(len(rows[i][3]) for i in order)
        tokens, positions, locations, tables, prefill, token_rows = [], [], [], [], [], []
        first = [0] * len(rows)
        for r, i in enumerate(order):
            start, ids, _, blocks = rows[i]
            first[i] = len(tokens)
            if len(ids) > 1:
                prefill.append((len(tokens), r, start, len(ids)))
            tokens += ids
            token_rows += [r] * len(ids)
            positions += range(start, start + len(ids))
            locations += (cache_index(blocks, p, block_size) for p in range(start, start + len(ids)))
            tables += padded_table(blocks, width, spare)
        # Logits in the caller's row order, whatever order the tokens run in.
        logits_at = []
        for i, (_, ids, want, _) in enumerate(rows):
            if all_logits:
                logits_at += range(first[i], first[i] + len(ids))
            else:
                logits_at += range(first[i] + len(ids) - want, first[i] + len(ids))
        n_decode = sum(1 for _, ids, _, _ in rows if len(ids) == 1)
        n_verify = sum(len(ids) for (_, ids, _, _), many in zip(rows, as_decode) if len(ids) > 1 and many)
        # One host-to-device copy for everything the forward reads.
        parts = (tokens, positions, locations, logits_at, tables, token_rows)
        values = array("q")
        for part in parts:
            values.extend(part)  # an array, not one list for torch.tensor, which reads its ints one at a time
        tokens_t, positions_t, locations_t, logits_t, tables_t, token_rows_t = to_device(
            torch.frombuffer(values, dtype=torch.long), device).split([len(part) for part in parts])
        decode_len = max(positions[:n_decode]) + 1 if n_decode else 0
        slots, groups = adapter_slots([adapters[i] for i in order] if adapters else [], token_rows, device)
        return cls(tokens_t, positions_t, locations_t, logits_t, tables_t.view(len(rows), width), block_size,
                   n_decode, decode_len, prefill, token_rows=token_rows_t, n_verify=n_verify, adapters=slots,
                   adapter_groups=groups)

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor:
        """[n_decode, 1, 1, decode_len] keys each decode row may see, made at first use: only PyTorch's decode
        attention reads it, so a step of the C kernels never compares its rows x keys."""
        keys = torch.arange(self.decode_len, device=self.positions.device).unsqueeze(0)
        return (keys <= self.positions[: self.n_decode].unsqueeze(1)).view(self.n_decode, 1, 1, self.decode_len)

    def tables_of(self, tokens: int) -> torch.Tensor:
        """The block table of each of the first `tokens` tokens (each a row of its own when they
        attend as decode rows): the decode rows' own, else picked by token_rows."""
        if tokens <= self.n_decode:
            return self.tables[:tokens]
        return self.tables.index_select(0, self.token_rows[:tokens])

    @classmethod
    def decode_by_index(cls, tokens: torch.Tensor, positions: torch.Tensor, locations: torch.Tensor,
                        tables: torch.Tensor, block_size: int, pool_blocks: int, windows: tuple[int, ...] = ()) -> Batch:
        """Decode rows given as device tensors (token, position, cache index and block table per row),
        for a step of static shapes: nothing here depends on their values, so one compiled graph
        serves them all.

        Attention reads each row's blocks only up to its own length, not padded to the longest row,
        through one block mask that every layer shares (and one for each of Llama 4's `windows`).
        """
        rows = torch.arange(len(tokens), device=tokens.device)
        windowed = {w: paged_block_mask(tables, positions, locations, block_size, pool_blocks, w) for w in windows}
        return cls(tokens, positions, locations, rows, tables, block_size, len(tokens), 0, [],
                   paged_block_mask(tables, positions, locations, block_size, pool_blocks), window_masks=windowed)


def adapter_slots(row_slots: list[int], token_rows: list[int],
                  device: torch.device) -> tuple[torch.Tensor | None, list[tuple[int, torch.Tensor]]]:
    """Each token's adapter slot (int32) and the tokens of each slot but the base's; (None, []) where every
    row is on the base, so a step without adapters does no LoRA work."""
    if not any(row_slots):
        return None, []
    slots = [row_slots[r] for r in token_rows]
    groups = [(s, to_device(torch.tensor([t for t, own in enumerate(slots) if own == s]), device))
              for s in sorted(set(slots) - {0})]
    return to_device(torch.tensor(slots, dtype=torch.int32), device), groups


def paged_block_mask(tables: torch.Tensor, positions: torch.Tensor, locations: torch.Tensor, block_size: int,
                     pool_blocks: int, window: int | None = None) -> BlockMask:
    """FlexAttention's mask of one query per row over the whole pool: row b reads the blocks of its
    table up to the one holding its position, and sees in that last block only the cache indices up
    to its own (locations[b]). Built on the device from the step's tensors, once a step, with no
    transposed (backward) block lists. window (a whole number of blocks): the blocks from the first of
    the row's window on (Llama 4's chunked attention).

    Every block goes in as a partial one (the mask evaluated there), none as full: FlexAttention's
    decoding kernel splits a row's partial blocks evenly over its parallel splits, but gives full
    blocks to the splits by position in the pool, so a row's full blocks would all run in one split,
    one after another (bench/gpu_profile.py).
    """
    rows, width = tables.shape
    first = positions // window * window // block_size if window else torch.zeros_like(positions)
    count = (positions // block_size + 1 - first).to(torch.int32).view(rows, 1, 1)
    # FlexAttention wants index lists as wide as the pool; entries past a row's count are never read.
    indices = torch.zeros((rows, 1, 1, pool_blocks), dtype=torch.int32, device=tables.device)
    ahead = (first.unsqueeze(1) + torch.arange(width, device=tables.device)).clamp(max=width - 1)
    indices[..., :width] = tables.gather(1, ahead).view(rows, 1, 1, width)

    if torch.compiler.is_compiling():
        def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            # Compiled, the mask is read in the row's own blocks only: all of each but the last.
            return (kv_idx // block_size != locations[b] // block_size) | (kv_idx <= locations[b])
    else:
        # Uncompiled FlexAttention (tests) evaluates the mask at every position of the pool: there it
        # needs which logical block of each row every pool block is (-1 for none).
        owner = torch.full((rows, pool_blocks), -1, dtype=torch.int32, device=tables.device)
        owner.scatter_(1, tables, torch.arange(width, dtype=torch.int32, device=tables.device).expand(rows, width))

        def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            logical = owner[b, kv_idx // block_size]
            return (logical >= first[b]) & (logical * block_size + kv_idx % block_size <= positions[b])

    return BlockMask.from_kv_blocks(count, indices, BLOCK_SIZE=block_size, mask_mod=visible,
                                    seq_lengths=(1, pool_blocks * block_size), compute_q_blocks=False)


def cache_index(blocks: list[int], position: int, block_size: int) -> int:
    """Where `position` of a sequence with block table `blocks` lives in the cache."""
    return blocks[position // block_size] * block_size + position % block_size


def padded_table(blocks: list[int], width: int, spare: int) -> list[int]:
    """A block table `width` long, the entries past its own blocks naming the spare block."""
    return blocks + [spare] * (width - len(blocks))


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without blocking the host (pinned first, for an asynchronous copy to a GPU)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
