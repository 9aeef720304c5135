"""What every rank runs in one step, as pure data, and its encoding for the one broadcast a step makes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Row:
    slot: int
    start: int
    tokens: list[int]
    sample: bool  # the row's last token is the newest of its sequence: pick the next one


@dataclass(frozen=True)
class StepPlan:
    """The rows of one step; `end` hands control back to rank 0's caller after it."""

    rows: list[Row]
    end: bool = True


class PlanWire:
    """A step plan as one fixed-size int64 tensor, so sending it is a single broadcast.

    Layout: [end, n_rows, n_tokens, rows x (slot, start, length, sample), tokens...].
    """

    def __init__(self, max_rows: int, max_tokens: int):
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.size = 3 + 4 * max_rows + max_tokens

    def encode(self, plan: StepPlan) -> torch.Tensor:
        tokens = [t for row in plan.rows for t in row.tokens]
        if len(plan.rows) > self.max_rows or len(tokens) > self.max_tokens:
            raise ValueError(f"plan of {len(plan.rows)} rows / {len(tokens)} tokens exceeds the wire's capacity")
        header = [int(plan.end), len(plan.rows), len(tokens)]
        rows = [v for row in plan.rows for v in (row.slot, row.start, len(row.tokens), int(row.sample))]
        wire = torch.zeros(self.size, dtype=torch.long)
        filled = header + rows
        wire[: len(filled)] = torch.tensor(filled, dtype=torch.long)
        wire[3 + 4 * self.max_rows : 3 + 4 * self.max_rows + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return wire

    def decode(self, wire: torch.Tensor) -> StepPlan:
        values = wire.tolist()
        end, n_rows, _ = values[:3]
        tokens = values[3 + 4 * self.max_rows :]
        rows, offset = [], 0
        for r in range(n_rows):
            slot, start, length, sample = values[3 + 4 * r : 7 + 4 * r]
            rows.append(Row(slot, start, tokens[offset : offset + length], bool(sample)))
            offset += length
        return StepPlan(rows, end=bool(end))
