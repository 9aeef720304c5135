"""Rank 0's scheduler: which sequences run in the next step, on which tokens, in which KV-cache blocks.

Only rank 0 holds sequences. Each step it turns them into rows of start position, tokens and block
table (`Scheduled`, sent as the step's `StepPlan`) that every rank runs as it is: arrivals,
cancellations, preemptions and finishes all happen here, between steps.

A step holds every decoding sequence (one token each) plus prompt chunks, up to `prefill_budget`
rows in all (as vLLM's max_num_batched_tokens), so a long prompt is prefilled over several steps while the
others keep decoding; a step that cuts a prompt is exactly the budget's size (a CPU matmul's cost goes by 32-row
blocks: bench/engine/rounds.py's mixed steps), one row less where it would leave a token alone (prompt_chunk).
Prompts get at least half the budget however many sequences decode.

Memory decides how many run: a sequence is admitted when the blocks its prompt still needs (after
the prefix cache's hits) are free, and grows a block at a time; when the pool runs dry mid-decode
the newest sequence is preempted (its blocks freed, its tokens recomputed later, as vLLM does; its
reply's tokens in rows that attend as the decode steps did, `Row.decoded`).

Speculative decoding (a `Speculator`) and grammars' forced tokens: a decode row may carry proposed
tokens after its newest one (engine/proposals.py), within its sequence's room (max_new_tokens,
max_seq_len), free blocks (never preempting for them) and half the budget; `commit` takes the accepted
ones with the picked token and drops the rest (their blocks go back; only accepted tokens reach the
prefix cache).

n > 1 (a group of one prompt, `Sequence.fork_of`): the first sequence carries the others until its
first token, so the prompt is computed once; every member takes its first token from the same logits
(`Scheduled.pickers`), then each fork shares the prompt's full blocks and copies the last, partly
filled one (`Row.copy`), as vLLM v0 did.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass

import torch

from tp_llama.engine.blocks import BlockPool
from tp_llama.engine.plan import Row
from tp_llama.engine.proposals import step_proposals
from tp_llama.engine.sampling import TokenLogprobs
from tp_llama.engine.scoring import prompt_scores
from tp_llama.engine.sequence import Sequence, check_sequence, prompt_chunk, readmitted_hits
from tp_llama.engine.speculate import Speculator
from tp_llama.lora.slots import AdapterRef

SPECULATE_STEP_TOKENS = 32  # decode tokens (proposals included) a step may reach and still carry proposals


@dataclass
class Scheduled:
    """One planned step on rank 0: its rows, the sequence each row belongs to, who samples from each
    sampling row."""

    rows: list[Row]
    sequences: list[Sequence]
    prompt_tokens: int  # how many of the rows' tokens are prompt
    # One list per sampling row, in row order: the sequences that pick a token from its logits (the
    # row's own sequence; at a group's first token, the group: its first sequence, then its forks).
    pickers: list[list[Sequence]]
    forced: list[int]  # per row, how many of its proposals are its grammar's forced tokens (engine/constraint.py)


@dataclass(frozen=True)
class Snapshot:
    """The scheduler's counts between steps, read at once (the handler's metrics)."""

    decoding: int
    waiting: int
    prefilling: int  # running sequences with prompt tokens still to compute
    blocks_used: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    proposed: int  # speculative decoding's totals: proposals made, taken, taken at each position, rows verified
    accepted: int
    accepted_at: tuple[int, ...]
    drafts: int


class Scheduler:
    """Admission in arrival order (preempted sequences first), by free blocks, a budget of rows per step."""

    def __init__(self, max_running: int, max_seq_len: int, prefill_budget: int, stop_ids: frozenset[int],
                 pool: BlockPool, speculator: Speculator | None = None, adapters: dict[str, AdapterRef] | None = None):
        """adapters: the LoRA adapters resident on every rank, by the name a sequence asks for (lora/serve.py)."""
        if max_running < 1 or prefill_budget < 1:
            raise ValueError("max_running and prefill_budget must be >= 1")
        if pool.blocks_for(max_seq_len) > pool.n_blocks:
            raise ValueError(f"a KV-cache pool of {pool.n_blocks} blocks of {pool.size} cannot hold one sequence "
                             f"of max_seq_len {max_seq_len}")
        self.max_running, self.max_seq_len, self.prefill_budget = max_running, max_seq_len, prefill_budget
        self.stop_ids, self.pool, self.speculator = stop_ids, pool, speculator
        self.adapters = adapters if adapters is not None else {}  # shared: adapters join it as they are loaded
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of admission: the last is preempted first
        self.preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, found there

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def snapshot(self) -> Snapshot:
        prefilling, spec = sum(1 for s in self.running if s.prefilling), self.speculator
        counts = (spec.proposed, spec.accepted, tuple(spec.accepted_at), spec.verified) if spec else (0, 0, (), 0)
        return Snapshot(len(self.running) - prefilling, len(self.waiting), prefilling, self.pool.used,
                        self.prefix_queries, self.prefix_hits, self.preemptions, *counts)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; one that can never run is refused here (ValueError), before it takes a block.

        n > 1: add the group's first sequence, then the others, each with `fork_of` naming the first,
        before the first is scheduled. Member i of a seeded group draws with seed + i, an unseeded
        one with its own random seed.
        """
        check_sequence(seq.prompt_ids, seq.params, self.max_seq_len)
        if seq.adapter is not None and seq.adapter not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {seq.adapter!r}; this engine has {sorted(self.adapters) or 'none'}")
        params, leader, index = seq.params, seq.fork_of, 0
        if leader is not None:
            self._check_fork(seq, leader)
            index = len(leader.forks) + 1
        if not params.greedy:
            seed = params.seed + index if params.seed is not None else secrets.randbits(63)
            seq.generator = torch.Generator().manual_seed(seed)
        (self.waiting if leader is None else leader.forks).append(seq)

    def _check_fork(self, seq: Sequence, leader: Sequence) -> None:
        if (seq.prompt_ids, seq.params, seq.cache_salt, seq.adapter) != (leader.prompt_ids, leader.params,
                                                                         leader.cache_salt, leader.adapter):
            raise ValueError("a fork has the prompt, params and cache_salt (and the adapter) of the sequence it forks from")
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
        pickers: list[list[Sequence]] = []
        # Room for every decoding sequence's next token first (preempting where the pool is dry); then
        # proposals take only the blocks left.
        decoding = [s for s in self.running if not s.prefilling]
        decoding = [s for s in decoding if s in self.running and self._room_for(s, s.computed + 1)]  # else preempted
        # A speculator's proposals go in steps of decode rows only: beside a prompt chunk the step is
        # compute-bound, every proposal costs what a prompt token does, and the cost fit (decode steps) does
        # not hold. A grammar's forced tokens go in any step: each is sure to be taken.
        spare = min(self.prefill_budget // 2, SPECULATE_STEP_TOKENS - len(decoding))  # tokens for proposals
        prompts = self.waiting or any(s.prefilling for s in self.running)
        per_row = self.speculator.per_row(len(decoding)) if self.speculator and spare > 0 and not prompts else 0
        proposals, forced = step_proposals(decoding, per_row, spare, self.pool, self.speculator, self.max_seq_len)
        for seq, proposal in zip(decoding, proposals):
            end = seq.computed + 1 + len(proposal)
            rows.append(Row(seq.computed, [seq.output[-1], *proposal], True, self._table(seq, end), copy=seq.copy,
                            proposed=len(proposal), adapter=self._slot(seq)))
            seq.copy = None
            owners.append(seq)
            pickers.append([seq])
        decode_tokens = sum(len(row.tokens) for row in rows)
        budget = start = max(self.prefill_budget - decode_tokens, self.prefill_budget // 2, 1)
        for seq in [s for s in self.running if s.prefilling] + list(self.waiting):
            if (budget < min(2, start) or seq not in self.running and not self._admit(seq)  # no lone token
                    or not (take := prompt_chunk(seq, budget, budget == start))):
                break
            chunk = seq.tokens[seq.computed : seq.computed + take]
            budget -= len(chunk)
            end = seq.computed + len(chunk)
            sample = end == len(seq.tokens) and seq.params.max_new_tokens > 0
            rows.append(Row(seq.computed, chunk, sample, self._table(seq, end), *prompt_scores(seq, seq.computed, end),
                            adapter=self._slot(seq), decoded=seq.computed >= len(seq.prompt_ids)))
            owners.append(seq)
            if sample:
                pickers.append([seq, *seq.forks])
        return Scheduled(rows, owners, start - budget, pickers, forced + [0] * (len(rows) - len(forced)))

    def commit(self, step: Scheduled, picked: list[int], logprobs: list[TokenLogprobs | None] | None = None,
               scores: list[list[TokenLogprobs] | None] | None = None,
               verified: dict[int, list[TokenLogprobs | None]] | None = None) -> list[Sequence]:
        """Record the step's results (one picked token per sampler, `step.pickers` flattened, and its
        log-probabilities where asked for; per row, the prompt log-probabilities it scored); returns the
        sequences it touched.

        verified: for each row with proposals (by index), the log-probabilities (or None) of the
        proposals it accepted, in order; the sampler's picked token comes after them."""
        now = time.perf_counter()
        tokens = iter(zip(picked, logprobs or [None] * len(picked)))
        pickers = iter(step.pickers)
        touched = list(step.sequences)
        for r, (row, seq, scored) in enumerate(zip(step.rows, step.sequences, scores or [None] * len(step.rows))):
            group = next(pickers) if row.sample else [seq]
            picks = [next(tokens) for _ in group] if row.sample else []
            touched += group[1:]
            # Cancelled while its step ran: left alone, unless a group's next sequence took its place.
            seq = next((s for s in group if not s.finished), None)
            if seq is None:
                continue
            if row.proposed:
                self._commit_verified(row, seq, (verified or {}).get(r, []), picks[0], now, step.forced[r])
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

    def _commit_verified(self, row: Row, seq: Sequence, accepted: list[TokenLogprobs | None],
                         pick: tuple[int, TokenLogprobs | None], now: float, forced: int) -> None:
        """A decode row with proposals (the first `forced` of them forced tokens): its newest token and the
        accepted proposals are in the cache (the blocks they fill join the prefix cache first, so a reply ending
        here leaves them to its next turn), the rest are dropped (the sequence's length goes back past them,
        and blocks holding only them go back to the pool); the accepted proposals, then the picked token, join
        its output."""
        seq.computed += 1 + len(accepted)
        self._remember_full_blocks(seq, row.tokens[1 : 1 + len(accepted)])
        if self.speculator is not None and row.proposed > forced:
            self.speculator.record(seq.id, row.proposed - forced, len(accepted) - forced)
        for token, token_logprobs in [*zip(row.tokens[1:], accepted), pick]:
            self._take(seq, token, token_logprobs, now)
            if seq.finished:
                return
        keep = self.pool.blocks_for(len(seq.prompt_ids) + len(seq.output))
        self.pool.release(seq.blocks[keep:])
        del seq.blocks[keep:]

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
        if len(seq.output) >= seq.params.max_new_tokens or len(seq.prompt_ids) + len(seq.output) >= self.max_seq_len:
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
        # The last token is computed, for its logits.
        hits = [] if scoring else readmitted_hits(seq, self.pool.match(tokens[:-1], self._salt(seq)), self.pool.size)
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

    def _slot(self, seq: Sequence) -> int:
        return 0 if seq.adapter is None else self.adapters[seq.adapter].slot

    def _salt(self, seq: Sequence) -> object:
        """The prefix cache's salt: the request's, and the digest of its adapter's weights (a block's keys
        and values depend on them)."""
        return seq.cache_salt if seq.adapter is None else (seq.cache_salt, self.adapters[seq.adapter].digest)

    def _table(self, seq: Sequence, positions: int) -> list[int]:
        return seq.blocks[: self.pool.blocks_for(positions)]

    def _remember_full_blocks(self, seq: Sequence, taken: list[int] = ()) -> None:
        """Filled blocks join the prefix cache (a chat's answer too, for its next turn); taken: proposals accepted."""
        size, tokens = self.pool.size, None
        for i in range(len(seq.keys), seq.computed // size):
            tokens = tokens or seq.tokens + list(taken)
            previous = seq.keys[-1] if seq.keys else None
            seq.keys.append(self.pool.remember(seq.blocks[i], previous, tuple(tokens[i * size : (i + 1) * size]),
                                               self._salt(seq)))

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.finished_at = time.perf_counter()
        if self.speculator is not None:
            self.speculator.forget(seq.id)
        if seq in self.running:
            self.running.remove(seq)
            self._keep_copy_sources(seq)
            self.pool.release(seq.blocks)
            seq.blocks, seq.keys = [], []

    def _keep_copy_sources(self, seq: Sequence) -> None:
        """`seq` leaves: a fork whose copy of one of its blocks is not made yet takes that block in place of
        its copy (one fork a block; the others copy it from that fork). A freed block could be rewritten
        before the copy: the self-draft writes the served KV cache while a step is planned (engine/draft.py)."""
        taken = set()
        for fork in self.running:
            if fork.copy is not None and fork.copy[0] in seq.blocks and fork.copy[0] not in taken:
                src, dst = fork.copy
                self.pool.take([src])
                self.pool.release([dst])
                fork.blocks[fork.blocks.index(dst)], fork.copy = src, None
                taken.add(src)
