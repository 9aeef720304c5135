"""Speculative decoding's proposals, on rank 0: tokens a decode row carries after its newest one, so that
one forward scores several positions of it (a step reads the weights once for all of them).

Two proposers: a draft model's greedy tokens (engine/draft.py, `Speculator.draft`), or
n-gram prompt lookup (vLLM's "ngram", llama.cpp's "ngram-simple"): the longest of the sequence's
last n tokens (ngram_max down to ngram_min) that also stands earlier in its prompt or output proposes
the tokens that followed its latest earlier occurrence. No second model; it pays where a reply
copies from its prompt (edits, quotes, forms), and proposes nothing elsewhere.

A proposal is a point mass, so verifying it is drawing each position's token from the model as
without speculation and accepting while the draw equals the proposal (engine/verify.py): replies do
not change. Speculation must not cost more than it saves, so two rules cut it back:
- a row stops proposing when its proposals are rarely taken (`Speculator.worth`);
- each step proposes only as many tokens a row as the measured cost of decode steps says pay
  (`Speculator.per_row`): a step's seconds are fitted as a + b x its tokens over the decode steps seen,
  and k proposals a row are worth it where the tokens they are expected to yield at the acceptance
  seen, (1 - p^(k+1)) / (1 - p) a row, come faster than one a row without them. A step of few rows
  over a large model costs about the same with more tokens (memory-bound); many rows, or a small
  model, make every token cost compute (bench/engine/speculative.py at 4 and 16 clients).
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tp_llama.engine.draft import Drafter
    from tp_llama.engine.sequence import Sequence

WARM_UP = 8  # proposals a row makes before its acceptance can switch it off
LEAST_ACCEPTANCE = 0.1  # below this share of its proposals taken, a row stops proposing
FORGET = 0.98  # each decode step's weight in the cost fit, against the one before
RETRY_STEPS = 256  # steps without proposals after which one is tried again (the cost or acceptance may have moved)


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
    verified: int = 0  # rows that carried proposals


@dataclass
class StepCost:
    """A decode step's seconds as a + b * its tokens, least squares over the steps seen, the recent ones
    weighing more (FORGET)."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weights, x, y, x^2, x*y

    def observe(self, tokens: int, seconds: float) -> None:
        self.sums = [FORGET * total + term for total, term in
                     zip(self.sums, (1.0, tokens, seconds, tokens * tokens, tokens * seconds))]

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None until steps of different sizes were seen."""
        n, x, y, xx, xy = self.sums
        spread = n * xx - x * x
        if n < 2 or spread <= 1e-9 * max(n * xx, 1.0):
            return None
        b = (n * xy - x * y) / spread
        return (y - b * x) / n, max(b, 0.0)


@dataclass
class Speculator:
    """Proposals for decode rows, and what became of them (per sequence and per position, for metrics)."""

    tokens: int  # proposals per row at most
    ngram_min: int
    ngram_max: int
    rows: dict[str, RowStats] = field(default_factory=dict)
    proposed: int = 0
    accepted: int = 0
    verified: int = 0  # rows that carried proposals
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[i]: proposals accepted at position i + 1
    cost: StepCost = field(default_factory=StepCost)
    idle: int = 0  # decode steps since the last that carried proposals
    draft: Drafter | None = None  # a draft model proposes (engine/draft.py), not n-gram lookup

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be >= 1 and <= ngram_max ({self.ngram_max})")
        self.accepted_at = [0] * self.tokens

    def worth(self, seq_id: str) -> bool:
        """Whether a row still proposes: always until WARM_UP proposals, then while enough are taken."""
        stats = self.rows.get(seq_id)
        return stats is None or stats.proposed < WARM_UP or stats.accepted >= LEAST_ACCEPTANCE * stats.proposed

    def per_row(self, rows: int) -> int:
        """Proposals a row for a step of `rows` decode rows: the count whose expected tokens per second,
        by the fitted step cost and the acceptance seen, beat none. One a row while the fit lacks a second
        size of step, and again after RETRY_STEPS steps without (the cheapest step that measures the
        slope: trying more at many rows had cost a step of several times the tokens)."""
        line = self.cost.line()
        if line is None or self.idle >= RETRY_STEPS:
            return 1
        a, b = line
        p = (self.accepted + 1) / (self.proposed + 2)  # the acceptance seen, a proposal's chance of being taken
        best, best_rate = 0, rows / (a + b * rows)
        for k in range(1, self.tokens + 1):
            rate = rows * (1 - p ** (k + 1)) / (1 - p) / (a + b * rows * (1 + k))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def observe(self, tokens: int, proposals: int, seconds: float) -> None:
        """A decode-only step of `tokens` tokens (its rows and their proposals) took `seconds`."""
        self.cost.observe(tokens, seconds)
        self.idle = 0 if proposals else self.idle + 1

    @property
    def drafts(self) -> bool:
        """Proposals come from a draft model, which writes its KV cache into the rows' blocks as it proposes."""
        return self.draft is not None

    def propose_rows(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """At most min(rooms[i], self.tokens) proposals after each sequence's tokens, none for a row that
        is not `worth` it; a draft model's for all rows in one batch of draft steps."""
        rooms = [min(room, self.tokens) if room > 0 and self.worth(seq.id) else 0 for seq, room in zip(seqs, rooms)]
        if self.draft is not None:
            return self.draft.propose(seqs, rooms)
        return [self.propose(seq.id, seq.tokens, room) if room else [] for seq, room in zip(seqs, rooms)]

    def propose(self, seq_id: str, tokens: Tokens[int], most: int) -> list[int]:
        """At most min(most, self.tokens) n-gram proposals after `tokens` (a sequence's prompt and output)."""
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
        self.verified += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    def forget(self, seq_id: str) -> None:
        self.rows.pop(seq_id, None)
        if self.draft is not None:
            self.draft.forget(seq_id)
