"""Constrained decoding: a grammar matcher (llguidance) per constrained sequence masks the tokens its
grammar cannot take next, before the sampler picks.

Only rank 0 holds matchers. A row's mask depends only on the tokens already picked, so a step's masks
are computed on a worker thread while the forward runs (llguidance releases the GIL), and applied to
the constrained rows of the logits once they arrive; each picked token then advances its row's
matcher. The tokenizer's stop tokens are the grammar's end of sequence: a mask allows them only where
the grammar accepts, and once the grammar is complete it allows nothing else.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.torch
import torch

from tp_llama.tokenizer import Tokenizer

# llguidance's own limits, set where a hostile grammar must fail fast rather than stall rank 0: the
# defaults allow grammars whose construction or a single mask takes far longer than a decode step.
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=100_000, max_grammar_size=200_000)


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


class _Vocabulary:
    """What llguidance.LLTokenizer reads of a tokenizer: each id's bytes and a way to encode text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.tokens = tokenizer.token_bytes()
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t.startswith(b"\xff")]
        self.is_tokenizer_wrapper = True
        self._byte_ids = {t[0]: i for i, t in enumerate(self.tokens) if len(t) == 1}

    def __call__(self, text: str | bytes) -> list[int]:
        """The ids of `text`, whose bytes are exactly the text's: SentencePiece adds a leading space to
        what it encodes, so where that changes the bytes the text is spelt byte by byte instead."""
        raw = text if isinstance(text, bytes) else text.encode("utf-8")
        try:
            ids = self._tokenizer.encode(raw.decode("utf-8"), bos=False)
        except UnicodeDecodeError:
            ids = []
        if b"".join(self.tokens[i] for i in ids) == raw:
            return ids
        return [self._byte_ids[b] for b in raw if b in self._byte_ids]


def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The tokenizer llguidance masks over (built once per model: it walks the whole vocabulary)."""
    return llguidance.LLTokenizer(_Vocabulary(tokenizer), n_vocab=tokenizer.n_words,
                                  eos_token=sorted(tokenizer.stop_ids))


@dataclass(eq=False)
class Constraint:
    """One sequence's grammar state; fork() gives a sibling its own copy at the same point."""

    matcher: llguidance.LLMatcher

    def fork(self) -> Constraint:
        return Constraint(self.matcher.deep_copy())

    def advance(self, token: int) -> bool:
        """Feed the picked token; False when the grammar refused it (the matcher says why)."""
        return self.matcher.consume_token(token)

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class Masks:
    """The bitmasks of a step's constrained rows, computed off the step's thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="token-masks")
        self._executor = llguidance.LLExecutor(1)

    def start(self, constraints: list[Constraint | None], n_words: int) -> Future | None:
        """Begin computing the masks of the rows that have a constraint (None: no row has one).

        The future's result is a bitmask [rows, ceil(n_words / 32)] int32, all bits set on the rows
        without a constraint."""
        rows = [(c.matcher, r) for r, c in enumerate(constraints) if c is not None]
        if not rows:
            return None
        bits = llguidance.torch.allocate_token_bitmask(len(constraints), n_words)
        return self._pool.submit(self._fill, rows, bits)

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int]], bits: torch.Tensor) -> torch.Tensor:
        llguidance.torch.fill_next_token_bitmask_par(self._executor, rows, bits)
        return bits

