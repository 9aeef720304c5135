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

n > 1 (a group: sequences of one prompt, `Sequence.fork_of`): the group's first sequence carries the
others until its first token, so the prompt is computed once; at that row every member takes its first
token from the same logits (`Scheduled.samplers`), then each fork shares the prompt's full blocks by
reference count and takes its own copy of the last, partly filled one (`Row.copy`), as vLLM v0 did.
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
    # n > 1: a fork names its group's first sequence (same prompt, params and cache salt), which carries
    # it (`forks`) until their first token; from then on each sequence of the group is on its own.
    fork_of: Sequence | None = None
    forks: list[Sequence] = field(default_factory=list)
    copy: tuple[int, int] | None = None  # a new fork's block copy (src, dst), sent with its next row

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
    """One planned step on rank 0: its rows, the sequence each row belongs to, who samples from each
    sampling row."""

    rows: list[Row]
    sequences: list[Sequence]
    prompt_tokens: int  # how many of the rows' tokens are prompt
    # One list per sampling row, in row order: the sequences that pick a token from its logits (the
    # row's own sequence; at a group's first token, the group: its first sequence, then its forks).
    samplers: list[list[Sequence]]


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
        """Queue a sequence; one that can never run is refused here (ValueError), before it takes a block.

        n > 1: add the group's first sequence, then the others, each with `fork_of` naming the first,
        before the first is scheduled. Member i of a seeded group draws with seed + i, an unseeded
        one with its own random seed.
        """
        check_sequence(seq.prompt_ids, seq.params, self.max_seq_len)
        params, leader, index = seq.params, seq.fork_of, 0
        if leader is not None:
            self._check_fork(seq, leader)
            index = len(leader.forks) + 1
        if params.temperature > 0:
            seed = params.seed + index if params.seed is not None else secrets.randbits(63)
            seq.generator = torch.Generator().manual_seed(seed)
        (self.waiting if leader is None else leader.forks).append(seq)

    def _check_fork(self, seq: Sequence, leader: Sequence) -> None:
        if (seq.prompt_ids, seq.params, seq.cache_salt) != (leader.prompt_ids, leader.params, leader.cache_salt):
            raise ValueError("a fork has the prompt, params and cache_salt of the sequence it forks from")
        if leader.fork_of is not None or leader.cached_tokens is not None or leader not in self.waiting:
            raise ValueError("a fork is added after its group's first sequence and before that one is scheduled")
        if seq.params.max_new_tokens < 1:
            raise ValueError("n > 1 needs max_new_tokens >= 1")
        n, prompt = len(leader.forks) + 2, len(seq.prompt_ids)
        if n > self.max_running:
            raise ValueError(f"a group of {n} sequences exceeds the {self.max_running} that may run at once")
        blocks = self.pool.blocks_for(prompt) + (n - 1) * (prompt % self.pool.size != 0)
        if blocks > self.pool.n_blocks:
            raise ValueError(f"a group of {n} sequences of a {prompt}-token prompt needs {blocks} KV-cache blocks, "
                             f"the pool has {self.pool.n_blocks}")

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End a sequence wherever it is (client gone, timeout, stop string); its blocks are free for the next step."""
        if seq.finished:
            return
        leader = seq.fork_of
        if leader is not None and seq in leader.forks:  # not forked yet: only the block kept for its copy goes
            leader.forks.remove(seq)
            self.pool.release(seq.blocks)
            seq.blocks = []
        elif seq.forks:
            self._hand_over(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason)

    def _hand_over(self, seq: Sequence) -> None:
        """A group's first sequence leaves before its first token: the next one carries the group on, in
        its place, with its blocks and progress (the block kept for its own copy goes back)."""
        heir, *rest = seq.forks
        self.pool.release(heir.blocks)
        heir.blocks, heir.keys, heir.computed = seq.blocks, seq.keys, seq.computed
        heir.cached_tokens, heir.prompt_logprobs = seq.cached_tokens, list(seq.prompt_logprobs)
        heir.fork_of, heir.forks = None, rest
        for fork in rest:
            fork.fork_of = heir
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue[queue.index(seq)] = heir
        seq.blocks, seq.keys, seq.forks = [], [], []

    def schedule(self) -> Scheduled:
        """The next step: every decoding sequence (each given room for its token), then prompt chunks
        up to the budget's rows."""
        rows: list[Row] = []
        owners: list[Sequence] = []
        samplers: list[list[Sequence]] = []
        for seq in [s for s in self.running if not s.prefilling]:
            if seq not in self.running or not self._room_for(seq, seq.computed + 1):
                continue  # preempted to make room for an older one
            rows.append(Row(seq.computed, [seq.output[-1]], True, self._table(seq, seq.computed + 1), copy=seq.copy))
            seq.copy = None
            owners.append(seq)
            samplers.append([seq])
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
            if sample:
                samplers.append([seq, *seq.forks])
        return Scheduled(rows, owners, start - budget, samplers)

    def commit(self, step: Scheduled, picked: list[int], logprobs: list[TokenLogprobs | None] | None = None,
               scores: list[list[TokenLogprobs] | None] | None = None) -> list[Sequence]:
        """Record the step's results (one picked token per sampler, `step.samplers` flattened, and its
        log-probabilities where asked for; per row, the prompt log-probabilities it scored); returns the
        sequences it touched."""
        now = time.perf_counter()
        tokens = iter(zip(picked, logprobs or [None] * len(picked)))
        samplers = iter(step.samplers)
        touched = list(step.sequences)
        for row, seq, scored in zip(step.rows, step.sequences, scores or [None] * len(step.rows)):
            group = next(samplers) if row.sample else [seq]
            picks = [next(tokens) for _ in group] if row.sample else []
            touched += group[1:]
            # Cancelled while its step ran: left alone, unless a group's next sequence took its place.
            seq = next((s for s in group if not s.finished), None)
            if seq is None:
                continue
            seq.computed += len(row.tokens)
            self._remember_full_blocks(seq)
            if scored is not None:  # a preempted sequence scores its prompt again: only the new positions count
                seq.prompt_logprobs += scored[len(seq.prompt_logprobs) - row.start :]
            if not row.sample:
                if seq.params.max_new_tokens == 0 and seq.computed >= len(seq.prompt_ids):
                    self._finish(seq, "length")  # prompt log-probabilities only
                continue
            at = self.running.index(seq) + 1
            for i, fork in enumerate(seq.forks):  # before any token: a stop token frees its sequence's blocks
                self._fork(seq, fork)
                self.running.insert(at + i, fork)
            seq.forks = []
            for member, (token, token_logprobs) in zip(group, picks):
                if not member.finished:
                    self._take(member, token, token_logprobs, now)
        return touched

    def _take(self, seq: Sequence, token: int, token_logprobs: TokenLogprobs | None, now: float) -> None:
        """A sequence's picked token: the next of its output, or its end."""
        if seq.first_token_at is None:
            seq.first_token_at = now
        if token in self.stop_ids and not seq.params.ignore_eos:
            self._finish(seq, "stop")
            return
        seq.output.append(token)
        if token_logprobs is not None:
            seq.logprobs.append(token_logprobs)
        if len(seq.output) >= seq.params.max_new_tokens or seq.computed + 1 >= self.max_seq_len:
            self._finish(seq, "length")

    def _fork(self, seq: Sequence, fork: Sequence) -> None:
        """A group's prompt is computed: `fork` shares its full blocks and takes the block kept for it
        at admission as its own copy of the last, partly filled one (made before its next row)."""
        full = seq.computed // self.pool.size
        shared = seq.blocks[:full]
        self.pool.take(shared)
        if fork.blocks:
            fork.copy = (seq.blocks[full], fork.blocks[0])
        fork.blocks = shared + fork.blocks
        fork.keys, fork.computed = list(seq.keys), seq.computed
        fork.cached_tokens, fork.prompt_logprobs = seq.cached_tokens, list(seq.prompt_logprobs)

    def _admit(self, seq: Sequence) -> bool:
        """Move the head of the queue to running with blocks for all its tokens, the prefix cache's first
        (a group: its prompt's blocks once, and a block for each fork's copy of the last, partly filled one)."""
        running = len(self.running) + sum(len(s.forks) for s in self.running)
        if running + 1 + len(seq.forks) > self.max_running or seq is not self.waiting[0]:
            return False
        tokens = seq.tokens
        scoring = seq.params.prompt_logprobs is not None  # cached blocks hold no logits: every position is computed
        hits = [] if scoring else self.pool.match(tokens[:-1], seq.cache_salt)  # the last token is computed, for its logits
        reviving = sum(1 for b in hits if self.pool.blocks[b].refs == 0)  # cached but free: they leave the queue
        needed = self.pool.blocks_for(len(tokens)) - len(hits)
        copies = len(seq.forks) if len(tokens) % self.pool.size else 0
        if needed + reviving + copies > len(self.pool.free):
            return False
        self.pool.take(hits)
        seq.blocks = hits + self.pool.allocate(needed)
        for fork in seq.forks:
            fork.blocks = self.pool.allocate(1) if copies else []
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
        """Back to the head of the queue, to be recomputed; a group before its first token goes whole."""
        self.running.remove(seq)
        self.pool.release(seq.blocks)
        for fork in seq.forks:
            self.pool.release(fork.blocks)
            fork.blocks = []
        seq.blocks, seq.keys, seq.computed, seq.copy = [], [], 0, None
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
