"""Rank 0's scheduler: which sequences run in the next step, on which tokens, in which KV-cache blocks.

Only rank 0 holds sequences. Each step it turns them into rows of start position, tokens and
block table (`Scheduled`, whose rows go out as the step's `StepPlan`) that every rank runs as it
is, so ranks never have to agree on anything else: arrivals, cancellations, preemptions and
finishes all happen here, between steps.

A step holds every sequence that is decoding (one token each) plus prompt chunks of waiting
or half-prefilled sequences, up to `prefill_budget` rows in all (decode rows included, as vLLM's
max_num_batched_tokens), so a long prompt is prefilled over several steps while the others keep
decoding, and a step that cuts a prompt is exactly the budget's size: on CPU a matmul's cost goes
by 32-row blocks, and 512 prompt rows beside three decode rows had cost a 17th block
(bench/engine/rounds.py's mixed steps). Prompts get at least half the budget however many
sequences decode.

Memory decides how many run: a sequence is admitted when the blocks its prompt still needs (after
the prefix cache's hits) are free, and grows a block at a time; when the pool runs dry mid-decode
the newest sequence is preempted (its blocks freed, its tokens recomputed later, as vLLM does).
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tp_llama.engine.blocks import BlockPool
from tp_llama.engine.plan import Row
from tp_llama.engine.sampling import SamplingParams, TokenLogprobs, check_params

if TYPE_CHECKING:
    from tp_llama.engine.constraint import Constraint


@dataclass(eq=False)
class Sequence:
    """One request from admission to its last token; the handler and the CLI hold it by id."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # prefixes are shared only between requests of the same salt
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.. (params.prompt_logprobs)
    blocks: list[int] = field(default_factory=list)  # block table: the KV-cache blocks of positions 0, B, 2B, ...
    keys: list[int] = field(default_factory=list)  # the prefix-cache key of each full block in `blocks`
    computed: int = 0  # tokens already written to the KV cache
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at admission
    preemptions: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    reported: int = 0  # output tokens already handed to the client
    constraint: Constraint | None = None  # a structured output's grammar state (rank 0; engine/constraint.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output

    @property
    def prefilling(self) -> bool:
        """More than the newest token still to compute: a prompt, or the tokens of a preempted sequence."""
        return self.computed < len(self.prompt_ids) + len(self.output) - 1 or not self.output

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
    if params.max_new_tokens < (0 if params.prompt_logprobs is not None else 1):
        raise ValueError(f"max_new_tokens must be >= 1 (0 only with prompt_logprobs), got {params.max_new_tokens}")
    if len(prompt_ids) + params.max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
            f"exceeds max_seq_len {max_seq_len}"
        )
    check_params(params)


def _prompt_scores(seq: Sequence, start: int, end: int) -> tuple[int, int, int]:
    """Row.score, scored and next_token for positions start .. end - 1 of a sequence: the positions whose
    next token is a prompt token not scored yet (all of them again after a preemption that lost some)."""
    top, last = seq.params.prompt_logprobs, len(seq.prompt_ids) - 1
    stop = min(end, last)
    if top is None or stop <= start or stop <= len(seq.prompt_logprobs):
        return -1, 0, -1
    return top, stop - start, seq.prompt_ids[end] if end <= last else -1


class Scheduler:
    """Admission in arrival order (preempted sequences first), by free blocks, a budget of rows per step."""

    def __init__(self, max_running: int, max_seq_len: int, prefill_budget: int, stop_ids: frozenset[int],
                 pool: BlockPool):
        if max_running < 1 or prefill_budget < 1:
            raise ValueError("max_running and prefill_budget must be >= 1")
        if pool.blocks_for(max_seq_len) > pool.n_blocks:
            raise ValueError(f"a KV-cache pool of {pool.n_blocks} blocks of {pool.size} cannot hold one sequence "
                             f"of max_seq_len {max_seq_len}")
        self.max_running, self.max_seq_len, self.prefill_budget = max_running, max_seq_len, prefill_budget
        self.stop_ids, self.pool = stop_ids, pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of admission: the last is preempted first
        self.preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, found there

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; one that can never run is refused here (ValueError), before it takes a block."""
        check_sequence(seq.prompt_ids, seq.params, self.max_seq_len)
        params = seq.params
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            seq.generator = torch.Generator().manual_seed(seed)
        self.waiting.append(seq)

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End a sequence wherever it is (client gone, timeout, stop string); its blocks are free for the next step."""
        if seq.finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason)

    def schedule(self) -> Scheduled:
        """The next step: every decoding sequence (each given room for its token), then prompt chunks
        up to the budget's rows."""
        rows: list[Row] = []
        owners: list[Sequence] = []
        for seq in [s for s in self.running if not s.prefilling]:
            if seq not in self.running or not self._room_for(seq, seq.computed + 1):
                continue  # preempted to make room for an older one
            rows.append(Row(seq.computed, [seq.output[-1]], True, self._table(seq, seq.computed + 1)))
            owners.append(seq)
        budget = start = max(self.prefill_budget - len(rows), self.prefill_budget // 2, 1)
        for seq in [s for s in self.running if s.prefilling] + list(self.waiting):
            if budget == 0:
                break
            if seq not in self.running and not self._admit(seq):
                break
            tokens = seq.tokens
            chunk = tokens[seq.computed : seq.computed + budget]
            budget -= len(chunk)
            end = seq.computed + len(chunk)
            sample = end == len(tokens) and seq.params.max_new_tokens > 0
            rows.append(Row(seq.computed, chunk, sample, self._table(seq, end), *_prompt_scores(seq, seq.computed, end)))
            owners.append(seq)
        return Scheduled(rows, owners, start - budget)

    def commit(self, step: Scheduled, picked: list[int], logprobs: list[TokenLogprobs | None] | None = None,
               scores: list[list[TokenLogprobs] | None] | None = None) -> list[Sequence]:
        """Record the step's results (one picked token per sampling row, and its log-probabilities
        where asked for; per row, the prompt log-probabilities it scored); returns the sequences it touched."""
        now = time.perf_counter()
        tokens = iter(zip(picked, logprobs or [None] * len(picked)))
        for row, seq, scored in zip(step.rows, step.sequences, scores or [None] * len(step.rows)):
            if seq.finished:  # cancelled while its step ran
                if row.sample:
                    next(tokens)
                continue
            seq.computed += len(row.tokens)
            self._remember_full_blocks(seq)
            if scored is not None:  # a preempted sequence scores its prompt again: only the new positions count
                seq.prompt_logprobs += scored[len(seq.prompt_logprobs) - row.start :]
            if not row.sample:
                if seq.params.max_new_tokens == 0 and seq.computed >= len(seq.prompt_ids):
                    self._finish(seq, "length")  # prompt log-probabilities only
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

    def _admit(self, seq: Sequence) -> bool:
        """Move the head of the queue to running with blocks for all its tokens, the prefix cache's first."""
        if len(self.running) >= self.max_running or seq is not self.waiting[0]:
            return False
        tokens = seq.tokens
        scoring = seq.params.prompt_logprobs is not None  # cached blocks hold no logits: every position is computed
        hits = [] if scoring else self.pool.match(tokens[:-1], seq.cache_salt)  # the last token is computed, for its logits
        reviving = sum(1 for b in hits if self.pool.blocks[b].refs == 0)  # cached but free: they leave the queue
        needed = self.pool.blocks_for(len(tokens)) - len(hits)
        if needed + reviving > len(self.pool.free):
            return False
        self.pool.take(hits)
        seq.blocks = hits + self.pool.allocate(needed)
        seq.keys = [self.pool.blocks[b].key for b in hits]
        seq.computed = len(hits) * self.pool.size
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.computed
            self.prefix_queries += 0 if scoring else len(tokens)
            self.prefix_hits += seq.computed
        self.waiting.popleft()
        self.running.append(seq)
        return True

    def _room_for(self, seq: Sequence, positions: int) -> bool:
        """Blocks for `positions` positions of a running sequence, preempting the newest others
        while the pool is dry; False when `seq` itself had to go."""
        while len(seq.blocks) < self.pool.blocks_for(positions):
            if self.pool.free:
                seq.blocks += self.pool.allocate(1)
                continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks, seq.keys, seq.computed = [], [], 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _table(self, seq: Sequence, positions: int) -> list[int]:
        return seq.blocks[: self.pool.blocks_for(positions)]

    def _remember_full_blocks(self, seq: Sequence) -> None:
        """Blocks the step filled join the prefix cache (a chat's answer included, for its next turn)."""
        size, tokens = self.pool.size, None
        for i in range(len(seq.keys), seq.computed // size):
            tokens = tokens or seq.tokens
            previous = seq.keys[-1] if seq.keys else None
            seq.keys.append(self.pool.remember(seq.blocks[i], previous, tuple(tokens[i * size : (i + 1) * size]),
                                               seq.cache_salt))

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.finished_at = time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
            self.pool.release(seq.blocks)
            seq.blocks, seq.keys = [], []
