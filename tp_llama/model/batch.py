"""The layout of one forward: every row's tokens in one sequence, and where each lands in the KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One forward: token t sits at positions[t] of cache slot slots[t].

    The first `n_decode` tokens are decode rows (one token each, slots ascending) that attend
    together over the cache slots [decode_lo, decode_hi); `prefill` lists the other rows as
    (first token index, slot, start position, length). Logits come back for the tokens at
    `logits_at` only.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits_at: torch.Tensor
    n_decode: int
    decode_lo: int
    decode_hi: int
    decode_rows: torch.Tensor | None  # slot - decode_lo of each decode token; None when they fill the range
    decode_mask: torch.Tensor | None  # [hi-lo, 1, 1, kv_len] keys each slot of the range may see
    prefill: list[tuple[int, int, int, int]]
    slot_seen: torch.Tensor | None = None  # decode_by_index: each cache slot's last visible position, -1 none

    @classmethod
    def build(cls, rows: list[tuple[int, int, list[int], bool]], device: torch.device, all_logits: bool = False) -> Batch:
        """rows: (slot, start position, tokens, want the logits of its last token); a row of one token decodes.

        Everything is computed on the host from Python ints and copied to the device at once: no
        device sync in the forward.
        """
        order = sorted(range(len(rows)), key=lambda i: (len(rows[i][2]) > 1, rows[i][0] if len(rows[i][2]) == 1 else i))
        decode = [rows[i] for i in order if len(rows[i][2]) == 1]
        tokens, positions, slots, prefill = [], [], [], []
        first = [0] * len(rows)
        for i in order:
            slot, start, ids, _ = rows[i]
            first[i] = len(tokens)
            if len(ids) > 1:
                prefill.append((len(tokens), slot, start, len(ids)))
            tokens += ids
            positions += range(start, start + len(ids))
            slots += [slot] * len(ids)
        # Logits in the caller's row order, whatever order the tokens run in.
        logits_at = []
        for i, (_, _, ids, want) in enumerate(rows):
            if all_logits:
                logits_at += range(first[i], first[i] + len(ids))
            elif want:
                logits_at.append(first[i] + len(ids) - 1)
        lo = decode[0][0] if decode else 0
        hi = decode[-1][0] + 1 if decode else 0
        index = [slot - lo for slot, *_ in decode]
        seen = [0] * (hi - lo)  # a hole in the decode range sees key 0 only
        for i, (_, start, _, _) in zip(index, decode):
            seen[i] = start
        # One host-to-device copy for everything the forward reads.
        parts = (tokens, positions, slots, logits_at, index, seen)
        tokens_t, positions_t, slots_t, logits_t, index_t, seen_t = to_device(
            torch.tensor([v for part in parts for v in part], dtype=torch.long), device
        ).split([len(part) for part in parts])
        decode_mask = None
        if decode:
            kv_len = max(seen) + 1
            decode_mask = (torch.arange(kv_len, device=device) <= seen_t.unsqueeze(1)).view(hi - lo, 1, 1, kv_len)
        return cls(tokens_t, positions_t, slots_t, logits_t, len(decode), lo, hi,
                   index_t if len(decode) != hi - lo else None, decode_mask, prefill)

    @classmethod
    def decode_by_index(cls, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        slot_seen: torch.Tensor) -> Batch:
        """Decode rows given as device tensors (token, position and slot per row; the last position
        each cache slot sees, -1 for none), for a step of static shapes: nothing here depends on their
        values, so one compiled graph serves them all.

        Attention reads each slot only up to its own length, not padded to the longest row.
        """
        rows = torch.arange(len(tokens), device=tokens.device)
        return cls(tokens, positions, slots, rows, len(tokens), 0, len(slot_seen), slots, None, [], slot_seen)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without blocking the host (pinned first, for an asynchronous copy to a GPU)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def dense_batch(tokens: torch.Tensor, start_pos: torch.Tensor, first_slot: int = 0, last_only: bool = True,
                device: torch.device | None = None) -> Batch:
    """Row b of tokens [B, S] at positions start_pos[b].. in cache slot first_slot + b, as one Batch on
    `device` (the tokens' own unless given).

    Its logits are those of each row's last position, or of every position with last_only=False.
    """
    slots = range(first_slot, first_slot + tokens.shape[0])
    spec = [(slot, int(start), ids, True) for slot, start, ids in zip(slots, start_pos.tolist(), tokens.tolist())]
    return Batch.build(spec, device or tokens.device, all_logits=not last_only)
