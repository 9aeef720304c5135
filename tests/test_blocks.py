"""The block pool and the scheduler's use of it: accounting that must not leak, the prefix cache
(chained keys, the token check, LRU eviction, salts), preemption when the pool runs dry, groups of
sequences of one prompt (n > 1) sharing its blocks.

The checks run the scheduler with a stand-in for the model: a KV cache of token ids that each step
makes the plan's block copies in, then writes every row's tokens to, at the slots of the row's block
table; each sampler then "picks" its token from the row's history as read back through that table
(and one draw of its generator, if it has one). Whatever a sequence produces depends only on its
tokens, never on the batch, and a wrong block table, a block shared too far or a missing copy shows as
a history that is not the sequence's: a preempted sequence or a group's member must end with the
tokens it would have had alone. A preempted sequence's reply must come back in rows of its own
(`Row.decoded`), never in a row with prompt tokens.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from tp_llama.engine import blocks
from tp_llama.engine.blocks import BlockPool
from tp_llama.engine.plan import StepPlan
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Scheduled, Scheduler, Sequence

SIZE = 4
KV: weakref.WeakKeyDictionary[Scheduler, dict[int, int]] = weakref.WeakKeyDictionary()  # each pool's cache slots


def scheduler_of(n_blocks: int, running: int = 8, max_seq_len: int = 64, budget: int = 64,
                 caching: bool = True) -> Scheduler:
    return Scheduler(running, max_seq_len, budget, frozenset({2}), BlockPool(n_blocks, SIZE, caching))


def seq(name: str, prompt: list[int], max_new: int = 4, salt: str | None = None, **params) -> Sequence:
    return Sequence(name, list(prompt), SamplingParams(max_new, **params), cache_salt=salt)


def group(name: str, prompt: list[int], n: int, max_new: int = 4, **params) -> list[Sequence]:
    """n sequences of one prompt: the first, then its forks."""
    first = seq(name, prompt, max_new, **params)
    return [first] + [Sequence(f"{name}#{i}", list(prompt), first.params, fork_of=first) for i in range(1, n)]


def next_token(history: list[int], generator: torch.Generator | None = None) -> int:
    """A deterministic function of a sequence's tokens so far (never the stop token 2), and of one draw
    of its generator where it samples."""
    draw = 0 if generator is None else int(torch.randint(1 << 30, (), generator=generator))
    return 3 + (sum(history) * 31 + len(history) + draw) % 90


def forward(scheduler: Scheduler, plan: Scheduled) -> list[int]:
    """The stand-in model's step (see the module's docstring): one token per sampler."""
    kv = KV.setdefault(scheduler, {})
    slot = lambda table, p: table[p // SIZE] * SIZE + p % SIZE  # noqa: E731
    for src, dst in StepPlan(plan.rows).copies:  # before any row writes
        assert src != dst and plan.rows
        for o in range(SIZE):
            kv[dst * SIZE + o] = kv.get(src * SIZE + o, -1)
    for row, s in zip(plan.rows, plan.sequences):
        assert row.blocks == s.blocks[: len(row.blocks)]
        assert len(row.blocks) * SIZE >= row.start + len(row.tokens)
        assert row.tokens == s.tokens[row.start : row.start + len(row.tokens)]
        # A preempted sequence's reply is computed again in rows of its own that attend as decode rows.
        prompt = len(s.prompt_ids)
        assert row.start >= prompt or row.start + len(row.tokens) <= prompt
        assert row.start < prompt or row.decoded or row.start == len(s.tokens) - 1  # else a decode row
        assert not row.decoded or row.start >= prompt
        for p, token in enumerate(row.tokens, row.start):
            kv[slot(row.blocks, p)] = token
    picked = []
    for row, pickers in zip([r for r in plan.rows if r.sample], plan.pickers, strict=True):
        history = [kv.get(slot(row.blocks, p), -1) for p in range(row.start + len(row.tokens))]
        for member in pickers:
            assert history == member.tokens, member.id
            picked.append(next_token(history, member.generator))
    return picked


def step(scheduler: Scheduler) -> Scheduled:
    plan = scheduler.schedule()
    scheduler.commit(plan, forward(scheduler, plan))
    check_books(scheduler)
    return plan


def run(scheduler: Scheduler, limit: int = 1000) -> int:
    """Steps to the end, the books checked after each; returns the prompt tokens the steps computed."""
    steps = prompt_tokens = 0
    while scheduler.has_work():
        prompt_tokens += step(scheduler).prompt_tokens
        steps += 1
        assert steps < limit
    return prompt_tokens


def check_books(scheduler: Scheduler) -> None:
    """Every block's reference count is the number of running tables holding it (a group not forked
    yet: its forks' blocks kept for their copies too); free = unreferenced."""
    pool = scheduler.pool
    holders = [0] * pool.n_blocks
    for s in scheduler.running:
        for b in s.blocks + [b for fork in s.forks for b in fork.blocks]:
            holders[b] += 1
    for s in scheduler.waiting:
        assert not s.blocks and not any(fork.blocks for fork in s.forks)
    assert [b.refs for b in pool.blocks] == holders
    assert set(pool.free) == {b.id for b in pool.blocks if b.refs == 0}
    for key, block_id in pool.cached.items():
        assert pool.blocks[block_id].key == key


def alone(prompt: list[int], max_new: int, **params) -> list[int]:
    s = seq("alone", prompt, max_new, **params)
    scheduler = scheduler_of(64, caching=False)
    scheduler.add(s)
    run(scheduler)
    return s.output


def test_blocks_are_taken_as_sequences_grow_and_all_come_back_however_they_end():
    scheduler = scheduler_of(32)
    prompts = [[10 + i] * (3 + 5 * i) for i in range(4)]
    seqs = [seq(str(i), p, max_new=6 + i) for i, p in enumerate(prompts)]
    for s in seqs:
        scheduler.add(s)
    plan = scheduler.schedule()
    assert [len(s.blocks) for s in seqs] == [1, 2, 4, 5]  # each prompt's blocks, taken at admission
    scheduler.commit(plan, forward(scheduler, plan))
    scheduler.cancel(seqs[1])  # a client that left
    scheduler.cancel(seqs[2], "stop")  # a stop string
    scheduler.cancel(seqs[3], "timeout")
    check_books(scheduler)
    run(scheduler)
    assert seqs[0].finish_reason == "length" and len(seqs[0].blocks) == 0
    assert scheduler.pool.used == 0 and all(b.refs == 0 for b in scheduler.pool.blocks)


def test_a_shared_prefix_is_prefilled_once_and_its_blocks_are_shared_while_both_run():
    scheduler = scheduler_of(32)
    system = list(range(20, 33))  # 13 tokens: 3 full blocks
    first, second = seq("a", system + [40, 41], 8), seq("b", system + [50], 8)
    scheduler.add(first)
    run(scheduler)
    assert first.cached_tokens == 0
    scheduler.add(second)
    third = seq("c", system + [60, 61, 62], 8)
    scheduler.add(third)
    plan = scheduler.schedule()
    assert second.cached_tokens == third.cached_tokens == 12
    assert [(r.start, len(r.tokens)) for r in plan.rows] == [(12, 2), (12, 4)]  # only the suffixes
    assert second.blocks[:3] == third.blocks[:3] and all(scheduler.pool.blocks[b].refs == 2 for b in second.blocks[:3])
    scheduler.commit(plan, forward(scheduler, plan))
    run(scheduler)
    assert second.output == alone(second.prompt_ids, 8) and third.output == alone(third.prompt_ids, 8)
    assert (scheduler.prefix_hits, scheduler.prefix_queries) == (24, 15 + 14 + 16)


def test_a_whole_cached_prompt_still_computes_its_last_token():
    scheduler = scheduler_of(32)
    prompt = list(range(20, 28))  # exactly 2 blocks
    for name in ("a", "b"):
        s = seq(name, prompt, 3)
        scheduler.add(s)
        run(scheduler)
    assert s.cached_tokens == 4 and s.output == alone(prompt, 3)


def test_an_answer_is_cached_for_the_next_turn_of_its_chat():
    scheduler = scheduler_of(32)
    turn1 = seq("t1", list(range(20, 30)), 9)
    scheduler.add(turn1)
    run(scheduler)
    history = turn1.tokens  # 10 prompt + 9 answer tokens; the last answer token was never computed
    turn2 = seq("t2", history + [70, 71], 4)
    scheduler.add(turn2)
    run(scheduler)
    assert turn2.cached_tokens == 16  # 4 full blocks: the prompt and the answer's first tokens


def test_a_hash_collision_is_caught_by_the_token_check(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(blocks, "chain_hash", lambda previous, tokens, salt: 1234)  # every block collides
    scheduler = scheduler_of(32)
    a = seq("a", list(range(20, 29)), 4)
    scheduler.add(a)
    run(scheduler)
    b = seq("b", list(range(50, 59)), 4)  # the same keys, other tokens
    scheduler.add(b)
    run(scheduler)
    assert b.cached_tokens == 0 and b.output == alone(b.prompt_ids, 4)
    c = seq("c", list(range(20, 29)), 4)  # a's first block, which is still cached under the key
    scheduler.add(c)
    run(scheduler)
    assert c.cached_tokens == 4


def test_salts_keep_prefixes_apart():
    scheduler = scheduler_of(32)
    prompt = list(range(20, 33))
    for name, salt, cached in (("a", "tenant-1", 0), ("b", "tenant-2", 0), ("c", None, 0), ("d", "tenant-1", 12)):
        s = seq(name, prompt, 2, salt)
        scheduler.add(s)
        run(scheduler)
        assert s.cached_tokens == cached, name


def test_free_blocks_stay_cached_and_the_least_recently_freed_go_first():
    scheduler = scheduler_of(8, max_seq_len=32)  # 8 blocks of 4
    old, new = seq("old", list(range(20, 29)), 1), seq("new", list(range(40, 49)), 1)
    for s in (old, new):
        scheduler.add(s)
        run(scheduler)  # 3 blocks each, freed when done: old's first
    pool = scheduler.pool
    assert pool.used == 0 and len(pool.cached) == 4  # two full blocks of each
    filler = seq("filler", list(range(60, 67)), 1)  # 2 blocks: the 2 never used, none of the cached
    scheduler.add(filler)
    run(scheduler)
    assert len(pool.cached) == 5  # filler's first block joined; no cached block was taken
    # 4 blocks, least recently freed first: old's (tail first: its partial block, then its 2 cached
    # ones), then new's partial one; new's cached blocks and filler's survive.
    big = seq("big", list(range(80, 95)), 1)
    scheduler.add(big)
    step(scheduler)
    run(scheduler)
    again_old, again_new = seq("o2", list(range(20, 29)), 1), seq("n2", list(range(40, 49)), 1)
    scheduler.add(again_new)
    run(scheduler)
    scheduler.add(again_old)
    run(scheduler)
    assert again_new.cached_tokens == 8 and again_old.cached_tokens == 0  # old was evicted before new


def test_when_the_pool_runs_dry_the_newest_is_preempted_and_finishes_with_its_own_tokens():
    prompts = [[10 + i] * 6 for i in range(4)]
    scheduler = scheduler_of(10, max_seq_len=40)  # 40 positions: 4 sequences of 6 + 20 do not fit at once
    seqs = [seq(str(i), p, 20) for i, p in enumerate(prompts)]
    for s in seqs:
        scheduler.add(s)
    run(scheduler)
    assert scheduler.preemptions > 0 and sum(s.preemptions for s in seqs) == scheduler.preemptions
    assert seqs[0].preemptions == 0  # the oldest is never the one to go
    for s, p in zip(seqs, prompts):
        assert s.output == alone(p, 20) and s.finish_reason == "length"
    assert scheduler.pool.used == 0


def test_a_pool_that_cannot_hold_one_sequence_is_refused():
    with pytest.raises(ValueError, match="cannot hold one sequence of max_seq_len 64"):
        scheduler_of(15, max_seq_len=64)


def seeded_alone(members: list[Sequence], seed: int) -> list[list[int]]:
    """What each member of a group seeded `seed` has alone: member i with seed + i."""
    first = members[0]
    return [alone(first.prompt_ids, first.params.max_new_tokens, temperature=1.0, seed=seed + i)
            for i in range(len(members))]


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
@pytest.mark.parametrize("prompt_len", [10, 8], ids=["partial-last-block", "whole-blocks"])
def test_a_group_computes_its_prompt_once_and_each_member_draws_as_it_would_alone(caching: bool, prompt_len: int):
    prompt = list(range(20, 20 + prompt_len))
    scheduler = scheduler_of(32, caching=caching)
    members = group("g", prompt, 3, max_new=9, temperature=1.0, seed=5)
    for s in members:
        scheduler.add(s)
    assert list(scheduler.waiting) == members[:1]
    plan = step(scheduler)  # the whole prompt in one row, its logits sampled by the three
    assert [len(r.tokens) for r in plan.rows] == [prompt_len] and plan.pickers == [members]
    assert scheduler.running == members and all(len(s.output) == 1 for s in members)
    full = prompt_len // SIZE
    shared = members[0].blocks[:full]
    assert all(s.blocks[:full] == shared for s in members)
    assert all(scheduler.pool.blocks[b].refs == 3 for b in shared)
    copies = StepPlan(step(scheduler).rows).copies  # each fork's own copy of the last, partly filled block
    assert copies == ([(members[0].blocks[full], s.blocks[full]) for s in members[1:]] if prompt_len % SIZE else [])
    computed = plan.prompt_tokens + run(scheduler)
    assert computed == prompt_len
    assert [s.output for s in members] == seeded_alone(members, 5)
    assert len({tuple(s.output) for s in members}) == 3  # seed + index: three streams
    assert scheduler.pool.used == 0
    apart = scheduler_of(32, caching=caching)  # the same three as separate requests: three prompts computed
    for s in [seq(str(i), prompt, 9) for i in range(3)]:
        apart.add(s)
    assert run(apart) == 3 * prompt_len


def test_groups_and_single_sequences_share_a_dry_pool_and_every_member_ends_with_its_own_tokens():
    """Forked members preempted (and recomputed alone), groups preempted before their fork (they stay
    groups); the books checked at every step."""
    scheduler = scheduler_of(10, max_seq_len=40)  # 40 positions: far from all of them at once
    groups = [group(f"g{i}", [10 + i] * 6, 3, max_new=20, temperature=1.0, seed=100 * i) for i in range(2)]
    single = seq("s", [30] * 7, 20)
    for members in groups:
        for s in members:
            scheduler.add(s)
    scheduler.add(single)
    run(scheduler)
    forks = [s for members in groups for s in members[1:]]
    assert scheduler.preemptions > 0 and sum(s.preemptions for s in forks) > 0
    for i, members in enumerate(groups):
        assert [s.output for s in members] == seeded_alone(members, 100 * i)
    assert single.output == alone(single.prompt_ids, 20)
    assert scheduler.pool.used == 0


def test_a_group_preempted_before_its_first_token_stays_a_group():
    scheduler = scheduler_of(8, max_seq_len=32, budget=2)  # one prompt token a step beside a decode row
    older = seq("old", [9] * 3, 20)
    scheduler.add(older)
    step(scheduler)
    members = group("g", list(range(40, 60)), 2, max_new=4, temperature=1.0, seed=3)
    for s in members:
        scheduler.add(s)
    while scheduler.has_work():
        before = members[0].preemptions
        plan = step(scheduler)
        if members[0].preemptions > before:  # the group went before its first token, whole
            assert members[0] in scheduler.waiting and not members[0].output
            assert members[0].forks == [members[1]] and not members[1].blocks
        # and came back as one: the fork's only rows are its own decode rows
        assert all(len(r.tokens) == 1 and members[1].output for r, s in zip(plan.rows, plan.sequences)
                   if s is members[1])
    assert members[0].preemptions == 1 and members[1].preemptions == 0
    assert [s.output for s in members] == seeded_alone(members, 3)
    assert older.output == alone(older.prompt_ids, 20)


def test_a_member_cancelled_frees_only_its_blocks_before_or_after_the_fork():
    scheduler = scheduler_of(32)
    prompt = list(range(20, 30))  # 2 full blocks and a partial one
    members = group("g", prompt, 4, max_new=6, temperature=1.0, seed=9)
    for s in members:
        scheduler.add(s)
    scheduler.schedule()  # admitted: 3 blocks for the prompt, one kept for each fork's copy
    assert scheduler.pool.used == 3 + 3
    scheduler.cancel(members[3])  # not forked yet: its kept block goes back
    assert scheduler.pool.used == 3 + 2 and members[0].forks == members[1:3]
    check_books(scheduler)
    scheduler.cancel(members[0])  # the group's first: the next one carries the group in its place
    assert scheduler.running == [members[1]] and members[1].forks == [members[2]] and scheduler.pool.used == 3 + 1
    check_books(scheduler)
    step(scheduler)  # the prompt again (that plan was never run), the group's first tokens
    assert scheduler.running == members[1:3] and scheduler.pool.used == 3 + 1
    scheduler.cancel(members[2])  # forked: its own block goes, the shared ones lose one reference
    assert scheduler.pool.used == 3 and all(scheduler.pool.blocks[b].refs == 1 for b in members[1].blocks)
    run(scheduler)
    want = seeded_alone(members, 9)
    assert members[1].output == want[1] and members[2].output == want[2][:1]
    assert [s.finish_reason for s in members] == ["cancelled", "length", "cancelled", "cancelled"]
    assert scheduler.pool.used == 0


def test_groups_that_cannot_run_are_refused_when_added():
    scheduler = scheduler_of(8, running=3, max_seq_len=32)
    first = seq("a", [5] * 9, 4)
    scheduler.add(first)
    with pytest.raises(ValueError, match="prompt, params and cache_salt"):
        scheduler.add(Sequence("b", [5] * 8, first.params, fork_of=first))
    with pytest.raises(ValueError, match="prompt, params and cache_salt"):
        scheduler.add(Sequence("b", [5] * 9, SamplingParams(5), fork_of=first))
    scheduler.add(Sequence("b", [5] * 9, first.params, fork_of=first))
    scheduler.add(Sequence("c", [5] * 9, first.params, fork_of=first))
    with pytest.raises(ValueError, match="a group of 4 sequences exceeds the 3"):
        scheduler.add(Sequence("d", [5] * 9, first.params, fork_of=first))
    wide = seq("w", [5] * 29, 3)  # 8 blocks, and one for the fork's copy: more than the pool's 8
    scheduler.add(wide)
    with pytest.raises(ValueError, match="needs 9 KV-cache blocks, the pool has 8"):
        scheduler.add(Sequence("w2", [5] * 29, wide.params, fork_of=wide))
    scored = seq("p", [5] * 3, 0, prompt_logprobs=1)
    scheduler.add(scored)
    with pytest.raises(ValueError, match="n > 1 needs max_new_tokens >= 1"):
        scheduler.add(Sequence("p2", [5] * 3, scored.params, fork_of=scored))
    scheduler.schedule()
    with pytest.raises(ValueError, match="before that one is scheduled"):
        scheduler.add(Sequence("late", [5] * 9, first.params, fork_of=first))
    assert len(first.forks) == 2


def test_a_group_taken_back_whole_when_one_of_it_is_refused_leaves_nothing_behind():
    """The handler adds a request's sequences all or none: on a refusal it cancels every one of them."""
    scheduler = scheduler_of(16, running=2)
    members = group("g", [5] * 6, 3)
    with pytest.raises(ValueError, match="a group of 3 sequences exceeds the 2"):
        for s in members:
            scheduler.add(s)
    for s in members:
        scheduler.cancel(s)
    assert not scheduler.has_work() and all(s.finish_reason == "cancelled" for s in members)
    single = seq("s", [7] * 5, 3)
    scheduler.add(single)
    run(scheduler)
    assert single.output == alone(single.prompt_ids, 3) and scheduler.pool.used == 0
