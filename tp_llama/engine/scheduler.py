"""Rank 0's scheduler: which sequences run in the next step, in which KV-cache slots, on which tokens.

Only rank 0 holds sequences. Each step it turns them into rows of slot, start position and tokens
(`Scheduled`, whose rows go out as the step's `StepPlan`) that every rank runs as it is, so ranks never have to agree on anything
else: arrivals, cancellations and finishes all happen here, between steps.

A step holds every sequence that is decoding (one token each) plus prompt chunks of waiting
or half-prefilled sequences, up to `prefill_budget` prompt tokens, so a long prompt is
prefilled over several steps while the others keep decoding.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tp_llama.engine.plan import Row
from tp_llama.engine.sampling import SamplingParams, TokenLogprobs, check_params


@dataclass(eq=False)
class Sequence:
    """One request from admission to its last token; the handler and the CLI hold it by id."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, when asked for
    slot: int | None = None
    computed: int = 0  # tokens already written to the KV cache
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    reported: int = 0  # output tokens already handed to the client

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt_ids)

    def take_new_tokens(self) -> tuple[list[int], list[TokenLogprobs]]:
        """Output tokens not handed out before (for streaming), and their log-probabilities if asked for."""
        new, logprobs = self.output[self.reported :], self.logprobs[self.reported :]
        self.reported = len(self.output)
        return new, logprobs


@dataclass
class Scheduled:
    """One planned step on rank 0: its rows, and the sequence each row belongs to."""

    rows: list[Row]
    sequences: list[Sequence]
    prompt_tokens: int  # how many of the rows' tokens are prompt


def check_sequence(prompt_ids: list[int], params: SamplingParams, max_seq_len: int) -> None:
    """The engine's own limits (the handler's request rules come first and say more)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if len(prompt_ids) + params.max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
            f"exceeds max_seq_len {max_seq_len}"
        )
    check_params(params)


class Scheduler:
    """Admission in arrival order, lowest free slot first, a prompt-token budget per step."""

    def __init__(self, slots: int, max_seq_len: int, prefill_budget: int, stop_ids: frozenset[int]):
        if slots < 1 or prefill_budget < 1:
            raise ValueError("slots and prefill_budget must be >= 1")
        self.slots, self.max_seq_len, self.prefill_budget = slots, max_seq_len, prefill_budget
        self.stop_ids = stop_ids
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self._free = list(range(slots))

    @property
    def busy_slots(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; one that can never run is refused here (ValueError), before it takes a slot."""
        check_sequence(seq.prompt_ids, seq.params, self.max_seq_len)
        params = seq.params
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            seq.generator = torch.Generator().manual_seed(seed)
        self.waiting.append(seq)

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End a sequence wherever it is (client gone, timeout, stop string); its slot is free for the next step."""
        if seq.finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason)

    def schedule(self) -> Scheduled:
        """The next step: every decoding sequence, then prompt chunks within the budget."""
        rows: list[Row] = []
        owners: list[Sequence] = []
        for slot in sorted(self.running):
            seq = self.running[slot]
            if not seq.prefilling:
                rows.append(Row(slot, seq.computed, [seq.output[-1]], True))
                owners.append(seq)
        budget = self.prefill_budget
        for seq in [s for s in self.running.values() if s.prefilling] + list(self.waiting):
            if budget == 0:
                break
            if seq.slot is None:
                if not self._free:
                    break
                self.waiting.remove(seq)
                seq.slot = self._free.pop(0)
                self.running[seq.slot] = seq
            chunk = seq.prompt_ids[seq.computed : seq.computed + budget]
            budget -= len(chunk)
            rows.append(Row(seq.slot, seq.computed, chunk, seq.computed + len(chunk) == len(seq.prompt_ids)))
            owners.append(seq)
        return Scheduled(rows, owners, self.prefill_budget - budget)

    def commit(self, step: Scheduled, picked: list[int], logprobs: list[TokenLogprobs | None] | None = None
               ) -> list[Sequence]:
        """Record the step's results (one picked token per sampling row, and its log-probabilities
        where asked for); returns the sequences it touched."""
        now = time.perf_counter()
        tokens = iter(zip(picked, logprobs or [None] * len(picked)))
        for row, seq in zip(step.rows, step.sequences):
            if seq.finished:  # cancelled while its step ran
                if row.sample:
                    next(tokens)
                continue
            seq.computed += len(row.tokens)
            if not row.sample:
                continue
            token, token_logprobs = next(tokens)
            if seq.first_token_at is None:
                seq.first_token_at = now
            if token in self.stop_ids and not seq.params.ignore_eos:
                self._finish(seq, "stop")
                continue
            seq.output.append(token)
            if token_logprobs is not None:
                seq.logprobs.append(token_logprobs)
            if len(seq.output) >= seq.params.max_new_tokens or seq.computed + 1 >= self.max_seq_len:
                self._finish(seq, "length")
        return step.sequences

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.finished_at = time.perf_counter()
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self._free.append(seq.slot)
            self._free.sort()
