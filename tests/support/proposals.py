"""A proposer whose proposals a test or a check chooses: every row, every step, at most the speculator's count."""

from __future__ import annotations

from tp_llama.engine.speculate import Speculator


class Scripted(Speculator):
    """Always worth proposing, at the speculator's count a row (every acceptance length is reached, whatever the
    steps cost); a subclass's `propose` says what."""

    def __init__(self, tokens: int = 4):
        super().__init__(tokens, 1, 1)

    def worth(self, seq_id: str) -> bool:
        return True

    def per_row(self, rows: int) -> int:
        return self.tokens
