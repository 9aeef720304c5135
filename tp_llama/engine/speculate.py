"""Speculative decoding's proposals, on rank 0: tokens a decode row carries after its newest one, so that
one forward scores several positions of it (a step reads the weights once for all of them).

n-gram prompt lookup (vLLM's "ngram", llama.cpp's "ngram-simple"): the longest of the sequence's
last n tokens (ngram_max down to ngram_min) that also stands earlier in its prompt or output proposes
the tokens that followed its latest earlier occurrence. No second model; it pays where a reply
copies from its prompt (edits, quotes, forms), and proposes nothing elsewhere.

A proposal is a point mass, so verifying it is drawing each position's token from the model as
without speculation and accepting while the draw equals the proposal (engine/verify.py): replies do
not change. A row stops proposing when its proposals are rarely taken (`Speculator.worth`), where a
longer row would cost more than its accepted tokens save.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

WARM_UP = 8  # proposals a row makes before its acceptance can switch it off
LEAST_ACCEPTANCE = 0.1  # below this share of its proposals taken, a row stops proposing


def ngram_proposal(tokens: Tokens[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    of n_max .. n_min tokens ([] where none occurs earlier)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = list(tokens[length - n :])
        for start in range(length - n - 1, -1, -1):  # latest first: replies tend to copy what is near
            if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + k])
    return []


@dataclass
class RowStats:
    proposed: int = 0
    accepted: int = 0


@dataclass
class Speculator:
    """Proposals for decode rows, and what became of them (per sequence and per position, for metrics)."""

    tokens: int  # proposals per row at most
    ngram_min: int
    ngram_max: int
    rows: dict[str, RowStats] = field(default_factory=dict)
    proposed: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[i]: proposals accepted at position i + 1

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be >= 1 and <= ngram_max ({self.ngram_max})")
        self.accepted_at = [0] * self.tokens

    def worth(self, seq_id: str) -> bool:
        """Whether a row still proposes: always until WARM_UP proposals, then while enough are taken."""
        stats = self.rows.get(seq_id)
        return stats is None or stats.proposed < WARM_UP or stats.accepted >= LEAST_ACCEPTANCE * stats.proposed

    def propose(self, seq_id: str, tokens: Tokens[int], most: int) -> list[int]:
        """At most min(most, self.tokens) proposals after `tokens` (a sequence's prompt and output)."""
        if most <= 0 or not self.worth(seq_id):
            return []
        return ngram_proposal(tokens, min(most, self.tokens), self.ngram_min, self.ngram_max)

    def record(self, seq_id: str, proposed: int, accepted: int) -> None:
        """A verified row: `accepted` of its `proposed` proposals taken."""
        stats = self.rows.setdefault(seq_id, RowStats())
        stats.proposed += proposed
        stats.accepted += accepted
        self.proposed += proposed
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1

    def forget(self, seq_id: str) -> None:
        self.rows.pop(seq_id, None)
