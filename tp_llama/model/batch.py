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

    @classmethod
    def build(cls, rows: list[tuple[int, int, list[int], bool]], device: torch.device, all_logits: bool = False) -> Batch:
        """rows: (slot, start position, tokens, want the logits of its last token); a row of one token decodes.

        Everything is computed on the host from Python ints: no device sync in the forward.
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
        decode_rows, decode_mask = None, None
        if decode:
            kv_len = max(start for _, start, _, _ in decode) + 1
            seen = torch.zeros(hi - lo, dtype=torch.long)  # a hole in the range sees key 0 only
            index = torch.tensor([slot - lo for slot, *_ in decode])
            seen[index] = torch.tensor([start for _, start, _, _ in decode])
            decode_mask = (torch.arange(kv_len) <= seen.unsqueeze(1)).view(hi - lo, 1, 1, kv_len).to(device)
            if len(decode) != hi - lo:
                decode_rows = index.to(device)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(
            as_tensor(tokens), as_tensor(positions), as_tensor(slots), as_tensor(logits_at),
            len(decode), lo, hi, decode_rows, decode_mask, prefill,
        )


def dense_batch(tokens: torch.Tensor, start_pos: torch.Tensor, first_slot: int = 0, last_only: bool = True) -> Batch:
    """Row b of tokens [B, S] at positions start_pos[b].. in cache slot first_slot + b, as one Batch.

    Its logits are those of each row's last position, or of every position with last_only=False.
    """
    slots = range(first_slot, first_slot + tokens.shape[0])
    spec = [(slot, int(start), ids, True) for slot, start, ids in zip(slots, start_pos.tolist(), tokens.tolist())]
    return Batch.build(spec, tokens.device, all_logits=not last_only)
