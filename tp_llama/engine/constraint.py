"""Constrained decoding: a grammar matcher (llguidance) per constrained sequence masks the tokens its
grammar cannot take next, before the sampler picks.

Only rank 0 holds matchers. A row's mask depends only on the tokens already picked (and its
proposals), so a step's masks are computed on a worker thread while the forward runs (llguidance
releases the GIL), and applied to the constrained rows of the logits once they arrive; each picked
token then advances its row's matcher. The tokenizer's stop tokens are the grammar's end of sequence:
a mask allows them only where the grammar accepts, and once the grammar is complete it allows nothing
else.

Forced tokens: where the grammar allows exactly one token (a schema's keys and punctuation),
llguidance names the run of them (`compute_ff_tokens`; its masks there hold that one token,
tests/test_forced.py checks it). The scheduler appends them to a row as proposals the row takes
without a draw (engine/verify.py) and advances the matcher past them at once, so their masks are
never computed and a schema's fixed keys cost one forward for many tokens.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
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

    def advance(self, tokens: list[int]) -> bool:
        """Feed the picked tokens; False when the grammar refused one (the matcher says why)."""
        return self.matcher.consume_tokens(tokens)

    def forced(self, most: int) -> list[int]:
        """Up to `most` tokens the grammar allows one at a time from here ([] once it has stopped)."""
        if most <= 0 or self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()[:most]

    def valid(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the front, the grammar takes from here."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


@dataclass
class StepMasks:
    """A step's masks: `bits` [masks, ceil(V / 32)] int32, and per constrained sampler (by index) the row
    of `bits` holding the mask of its first drawn position; its later positions follow it."""

    bits: torch.Tensor
    first: dict[int, int]


class Masks:
    """The bitmasks of a step's constrained rows, computed off the step's thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="token-masks")
        self._executor = llguidance.LLExecutor(1)

    def start(self, rows: dict[int, tuple[Constraint, list[int]]], n_words: int) -> Future:
        """Begin computing, per constrained sampler (by index), the masks of its drawn positions: where
        its matcher stands, then after each of its proposals (`rows`: its constraint and the proposals
        it draws against, forced ones excluded). The future's result is a StepMasks."""
        first, jobs, at = {}, [], 0
        for sampler, (constraint, proposals) in rows.items():
            first[sampler] = at
            jobs.append((constraint.matcher, at, proposals))
            at += 1 + len(proposals)
        bits = torch.full((at, (n_words + 31) // 32), -1, dtype=torch.int32)  # a bit a token, 32 to a word
        return self._pool.submit(self._fill, jobs, StepMasks(bits, first))

    def _fill(self, jobs: list[tuple[llguidance.LLMatcher, int, list[int]]], masks: StepMasks) -> StepMasks:
        """The executor writes each job's rows of the bitmask in place (llguidance.torch's helpers do the same, but
        importing that module imports torch's compiler: seconds more at every worker's start)."""
        bits, row_bytes = masks.bits, masks.bits.shape[1] * 4
        speculating = [job for job in jobs if job[2]]  # llguidance's draft-token call refuses none
        if speculating:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(speculating, bits.data_ptr(), row_bytes, len(bits))
        if len(speculating) < len(jobs):
            self._executor.unsafe_compute_mask_ptr([job[:2] for job in jobs if not job[2]], bits.data_ptr(), row_bytes,
                                                   len(bits))
        return masks

