"""What every rank runs in one step, as pure data, and its encoding for the broadcast a step makes."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Row:
    start: int  # position of the first token
    tokens: list[int]
    sample: bool  # the row's last token is the newest of its sequence: pick the next one
    blocks: list[int]  # the sequence's block table, as far as the row's last position
    # Prompt log-probabilities (an echo request, the perplexity CLI): the first `scored` positions'
    # next tokens scored, each with the `score` most likely (-1: none); the last position's next token,
    # not in the row, is `next_token`.
    score: int = -1
    scored: int = 0
    next_token: int = -1
    # (src, dst): before the step's forward, block dst becomes a copy of block src. A sequence forked
    # from its group's prompt (n > 1) takes its own copy of the prompt's last, partly filled block on
    # its first row.
    copy: tuple[int, int] | None = None
    # Speculative decoding: the row's last `proposed` tokens are proposals after its sequence's newest
    # token; logits come back for the newest token and each proposal (proposed + 1 of them).
    proposed: int = 0
    adapter: int = 0  # the LoRA adapter's slot its tokens run through (0: the base; lora/slots.py)
    # A preempted sequence's reply, computed again: its tokens attend as decode rows, so that their keys and values
    # get the bits the decode steps that made them gave (prompt rows' differ: bfloat16, heads of 64).
    decoded: bool = False

    @property
    def logits_wanted(self) -> int:
        """How many of the row's last positions return logits: none, one, or one per proposal and one."""
        return self.proposed + 1 if self.sample else 0

    def targets(self) -> list[int]:
        """The token each scored position predicts."""
        return (self.tokens[1:] + [self.next_token])[: self.scored]


@dataclass(frozen=True)
class StepPlan:
    """The rows of one step; `end` hands control back to rank 0's caller after it; `draft`: the rows run
    through the draft model (engine/draft.py), into its own KV cache, instead of the served one."""

    rows: list[Row]
    end: bool = True
    draft: bool = False
    load: int = -1  # >= 0: no forward; every rank writes the LoRA adapter rank 0 sends next into this slot

    @property
    def copies(self) -> list[tuple[int, int]]:
        """The block copies (src, dst) every rank makes before the step's forward."""
        return [row.copy for row in self.rows if row.copy is not None]


# Block ids the wire holds itself: every row's whole table up to 4,096 positions at 32 rows. A step with more
# (long contexts) sends the rest in a second broadcast, so that the broadcast every step makes does not grow
# with max_seq_len (bench/engine/plan_wire.py).
INLINE_BLOCKS = 8192


class PlanWire:
    """A step plan as a fixed-size int64 tensor, and the block ids past its room in a second one where a step has
    more: a step is one broadcast, or two at long contexts.

    Layout: [end, n_rows, draft, load, rows x (start, length, sample, n_blocks, score, scored, next_token, copy src,
    copy dst, proposed, adapter, decoded), tokens..., block ids...]; a row without a copy has -1 for both.
    """

    FIELDS = 12

    def __init__(self, max_rows: int, max_tokens: int, max_blocks: int):
        self.max_rows, self.max_tokens, self.max_blocks = max_rows, max_tokens, max_blocks
        self.inline_blocks = min(max_blocks, INLINE_BLOCKS)
        self.size = 4 + self.FIELDS * max_rows + max_tokens + self.inline_blocks

    def encode(self, plan: StepPlan) -> list[torch.Tensor]:
        """The wire, then the block ids past its room (only where the plan has more)."""
        head = array("q", [int(plan.end), len(plan.rows), int(plan.draft), plan.load])
        tokens, blocks = array("q"), array("q")
        for row in plan.rows:
            head.extend((row.start, len(row.tokens), int(row.sample), len(row.blocks), row.score, row.scored,
                         row.next_token, *(row.copy or (-1, -1)), row.proposed, row.adapter, int(row.decoded)))
            tokens.extend(row.tokens)
            blocks.extend(row.blocks)
        if len(plan.rows) > self.max_rows or len(tokens) > self.max_tokens or len(blocks) > self.max_blocks:
            raise ValueError(f"plan of {len(plan.rows)} rows / {len(tokens)} tokens / {len(blocks)} blocks exceeds "
                             "the wire's capacity")
        wire = torch.zeros(self.size, dtype=torch.long)
        at = 4 + self.FIELDS * self.max_rows
        wire[: len(head)] = _longs(head)
        wire[at : at + len(tokens)] = _longs(tokens)
        at += self.max_tokens
        inline = blocks[: self.inline_blocks]
        wire[at : at + len(inline)] = _longs(inline)
        return [wire] if len(blocks) <= self.inline_blocks else [wire, _longs(blocks[self.inline_blocks :])]

    def rest_size(self, wire: torch.Tensor) -> int:
        """How many block ids the plan in `wire` sends in a second part (0: none)."""
        n_rows = int(wire[1])
        return max(int(wire[4 : 4 + self.FIELDS * n_rows].view(n_rows, self.FIELDS)[:, 3].sum()) - self.inline_blocks,
                   0)

    def decode(self, parts: list[torch.Tensor]) -> StepPlan:
        """The plan back, reading only the parts of the wire it fills (the block region is large)."""
        wire = parts[0]
        end, n_rows, draft, load = wire[:4].tolist()
        fields = wire[4 : 4 + self.FIELDS * n_rows].view(n_rows, self.FIELDS).tolist()
        at = 4 + self.FIELDS * self.max_rows
        tokens = wire[at : at + sum(f[1] for f in fields)].tolist()
        at += self.max_tokens
        blocks = wire[at : at + min(sum(f[3] for f in fields), self.inline_blocks)].tolist()
        if len(parts) > 1:
            blocks += parts[1].tolist()
        rows, t, b = [], 0, 0
        for start, length, sample, n_blocks, score, scored, next_token, src, dst, proposed, adapter, decoded in fields:
            rows.append(Row(start, tokens[t : t + length], bool(sample), blocks[b : b + n_blocks], score, scored,
                            next_token, (src, dst) if src >= 0 else None, proposed, adapter, bool(decoded)))
            t, b = t + length, b + n_blocks
        return StepPlan(rows, end=bool(end), draft=bool(draft), load=load)


def _longs(values: array) -> torch.Tensor:
    """An int64 tensor over an array's buffer (torch.tensor reads a list's ints one at a time)."""
    return torch.frombuffer(values, dtype=torch.long) if values else torch.empty(0, dtype=torch.long)
