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
- a row stops proposing while its recent proposals are rarely taken, and tries once more after a few
  steps, twice as many after each try that fails (`Speculator.worth`): a reply that opens in free text
  often copies later (bench/engine/speculative.py);
- each step proposes only as many tokens a row as measured steps of its size say pay
  (`Speculator.per_row`, engine/proposal_counts.py): few rows over a large model cost about the same
  with more tokens (memory-bound); many rows, or a small model, make every token cost compute.
A row whose n-gram proposals were all taken, its recent ones nearly all (COPYING), carries twice as many
at its next step, past that count (a reply copying a passage verifies it in runs of 8, 16, ... tokens,
each token of a long step costing a fraction of a decode step); a rejection brings it back. A draft's
rows never grow: each of their proposals costs a draft step.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tp_llama.engine.proposal_counts import ProposalCounts

if TYPE_CHECKING:
    from tp_llama.engine.draft import Drafter
    from tp_llama.engine.sequence import Sequence

WARM_UP = 8  # proposals a row makes before its acceptance can switch it off
LEAST_ACCEPTANCE = 0.1  # below this share of its recent proposals taken, a row stops proposing
RECENT = 0.75  # at each verification a row's earlier proposals weigh this much less
PROBE_STEPS = 8  # steps a row that stopped proposing waits before it proposes once more, at first
LONGEST_WAIT = 128  # each such try that fails doubles the wait up to this
COPYING = 0.9  # a row whose recent proposals were taken this often, its last all, doubles its next ones


class NgramIndex:
    """A sequence's n-grams (ngram_min .. ngram_max tokens) by their latest start, kept as the sequence
    grows, so that a proposal costs the same at any context length (scanning the context back for the
    suffix cost each row and step in proportion to it). Keys are the n-grams' hashes: a collision only
    proposes tokens verification rejects, never changes a reply."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.latest: dict[int, int] = {}
        self.indexed = 0  # every n-gram ending before this position is in `latest`
        self.last = -1  # the token at indexed - 1, to notice a token list that is not this one grown

    def propose(self, tokens: Tokens[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
        of n_max .. n_min tokens ([] where none occurs earlier). `tokens`: the list of the last call,
        grown (else the index starts again)."""
        length = len(tokens)
        if length - 1 < self.indexed or (self.indexed and tokens[self.indexed - 1] != self.last):
            self.latest, self.indexed = {}, 0
        for end in range(self.indexed, length - 1):  # n-grams ending at end: only earlier ones may match
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self.latest[hash(tuple(tokens[end + 1 - n : end + 1]))] = end + 1 - n
        if length > 1:
            self.indexed, self.last = length - 1, tokens[length - 2]
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            start = self.latest.get(hash(tuple(tokens[length - n :])))
            if start is not None:
                return list(tokens[start + n : start + n + k])
        return []


@dataclass
class RowStats:
    proposed: float = 0.0  # recent proposals (each verification weighs the earlier ones by RECENT)
    accepted: float = 0.0  # of them, the ones taken
    made: int = 0  # proposals in all
    resting: int = 0  # steps without proposing since it last proposed, while switched off
    wait: int = PROBE_STEPS  # the steps it waits, switched off, before it proposes once more
    run: int = 0  # n-gram proposals its next step may carry whatever the step's count (while copying)

    def on(self) -> bool:
        return self.made < WARM_UP or self.accepted >= LEAST_ACCEPTANCE * self.proposed


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
    indexes: dict[str, NgramIndex] = field(default_factory=dict)  # each sequence's n-grams
    counts: ProposalCounts = field(init=False)
    draft: Drafter | None = None  # a draft model proposes (engine/draft.py), not n-gram lookup

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be >= 1 and <= ngram_max ({self.ngram_max})")
        self.accepted_at = [0] * self.tokens
        self.counts = ProposalCounts(self.tokens)

    def worth(self, seq_id: str) -> bool:
        """Whether a row proposes this step (asked once a row and step): always until WARM_UP proposals, then
        while enough of its recent ones are taken; switched off, once its wait is over."""
        stats = self.rows.get(seq_id)
        if stats is None or stats.on():
            return True
        stats.resting += 1
        if stats.resting < stats.wait:
            return False
        stats.resting = 0
        return True

    def row_most(self, seq_id: str, most: int) -> int:
        """Proposals a row may carry in a step whose count is `most` (> 0): more while it copies (its last
        n-gram proposals all taken, its recent ones nearly all: its run doubles at each such step)."""
        stats = self.rows.get(seq_id)
        return most if stats is None or self.draft is not None else max(most, stats.run)

    def per_row(self, rows: int) -> int:
        """Proposals a row for a step of `rows` decode rows (engine/proposal_counts.py)."""
        return self.counts.choose(rows)

    def observe(self, tokens: int, seconds: float) -> None:
        """A decode-only step gave `tokens` tokens (picked and accepted) in `seconds`, drafting included."""
        self.counts.observe(tokens, seconds)

    @property
    def drafts(self) -> bool:
        """Proposals come from a draft model, which writes its KV cache into the rows' blocks as it proposes."""
        return self.draft is not None

    def propose_rows(self, seqs: list[Sequence], rooms: list[int], after: list[list[int]]) -> list[list[int]]:
        """At most rooms[i] proposals after each sequence's tokens and its `after` (the
        forced tokens it carries), none for a row that is not `worth` it; a draft model's for all rows in
        one batch of draft steps."""
        rooms = [room if room > 0 and self.worth(seq.id) else 0 for seq, room in zip(seqs, rooms)]
        if self.draft is not None:
            return self.draft.propose(seqs, rooms, after)
        return [self.propose(seq.id, seq.tokens + more, room) if room else []
                for seq, room, more in zip(seqs, rooms, after)]

    def propose(self, seq_id: str, tokens: Tokens[int], most: int) -> list[int]:
        """At most `most` n-gram proposals after `tokens` (a sequence's prompt and output);
        propose_rows asks first whether the row is `worth` them."""
        if most <= 0:
            return []
        index = self.indexes.setdefault(seq_id, NgramIndex(self.ngram_min, self.ngram_max))
        return index.propose(tokens, most)

    def record(self, seq_id: str, proposed: int, accepted: int) -> None:
        """A verified row: `accepted` of its `proposed` proposals taken."""
        stats = self.rows.setdefault(seq_id, RowStats())
        tried = not stats.on()  # proposals of a row switched off: a try after its wait
        stats.proposed = RECENT * stats.proposed + proposed
        stats.accepted = RECENT * stats.accepted + accepted
        stats.made += proposed
        copying = proposed and accepted == proposed and stats.accepted >= COPYING * stats.proposed
        stats.run = 2 * proposed if copying else 0
        if stats.on():
            stats.wait = PROBE_STEPS
        elif tried:
            stats.wait = min(2 * stats.wait, LONGEST_WAIT)
        self.proposed += proposed
        self.accepted += accepted
        self.verified += 1
        self.accepted_at += [0] * (accepted - len(self.accepted_at))  # a run may pass `tokens`
        for i in range(accepted):
            self.accepted_at[i] += 1

    def forget(self, seq_id: str) -> None:
        self.rows.pop(seq_id, None)
        self.indexes.pop(seq_id, None)
        if self.draft is not None:
            self.draft.forget(seq_id)
