"""The block pool and the scheduler's use of it: accounting that must not leak, the prefix cache
(chained keys, the token check, LRU eviction, salts), preemption when the pool runs dry.

The checks run the scheduler with a stand-in for the model that "picks" tokens from each row's
own history, so whatever a sequence produces depends only on its tokens, not on the batch: a
preempted sequence must then end with the tokens it would have had alone.
"""

from __future__ import annotations

import pytest

from tp_llama.engine import blocks
from tp_llama.engine.blocks import BlockPool
from tp_llama.engine.scheduler import SamplingParams, Scheduler, Sequence

SIZE = 4


def scheduler_of(n_blocks: int, running: int = 8, max_seq_len: int = 64, budget: int = 64,
                 caching: bool = True) -> Scheduler:
    return Scheduler(running, max_seq_len, budget, frozenset({2}), BlockPool(n_blocks, SIZE, caching))


def seq(name: str, prompt: list[int], max_new: int = 4, salt: str | None = None) -> Sequence:
    return Sequence(name, list(prompt), SamplingParams(max_new), cache_salt=salt)


def next_token(history: list[int]) -> int:
    """A deterministic function of a sequence's tokens so far (never the stop token 2)."""
    return 3 + (sum(history) * 31 + len(history)) % 90


def run(scheduler: Scheduler, limit: int = 1000) -> int:
    """Steps to the end; checks every planned row against the sequence it belongs to."""
    steps = 0
    while scheduler.has_work():
        plan = scheduler.schedule()
        picked = []
        for row, s in zip(plan.rows, plan.sequences):
            assert row.blocks == s.blocks[: len(row.blocks)]
            assert len(row.blocks) * SIZE >= row.start + len(row.tokens)
            assert row.tokens == s.tokens[row.start : row.start + len(row.tokens)]
            if row.sample:
                picked.append(next_token(s.tokens))
        scheduler.commit(plan, picked)
        check_books(scheduler)
        steps += 1
        assert steps < limit
    return steps


def check_books(scheduler: Scheduler) -> None:
    """Every block's reference count is the number of running tables holding it; free = unreferenced."""
    pool = scheduler.pool
    holders = [0] * pool.n_blocks
    for s in scheduler.running:
        for b in s.blocks:
            holders[b] += 1
    assert [b.refs for b in pool.blocks] == holders
    assert set(pool.free) == {b.id for b in pool.blocks if b.refs == 0}
    for key, block_id in pool.cached.items():
        assert pool.blocks[block_id].key == key


def alone(prompt: list[int], max_new: int) -> list[int]:
    s = seq("alone", prompt, max_new)
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
    scheduler.commit(plan, [next_token(s.tokens) for s in seqs])
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
    scheduler.commit(plan, [next_token(second.tokens), next_token(third.tokens)])
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
    plan = scheduler.schedule()
    scheduler.commit(plan, [next_token(big.tokens)])
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
