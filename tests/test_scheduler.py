"""The scheduler's plans and block accounting, and the model running any mix of rows.

The model checks compare a row's logits inside mixed batches (chunked prefill, decode rows in
scattered blocks) with the same sequence run alone in one piece; tests/test_parity.py
compares the whole path with the independent float64 reference.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from tests.support.dist_util import run_ranks
from tests.support.run_model import dense_logits, setup_slots, slot_batch
from tp_llama import backend
from tp_llama.engine.blocks import BlockPool
from tp_llama.engine.plan import PlanWire, Row, StepPlan
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Scheduler, Sequence
from tp_llama.model import ModelArgs, Transformer

EOS = 2


def seq(name: str, prompt_len: int, max_new: int = 4, **kw) -> Sequence:
    return Sequence(name, list(range(10, 10 + prompt_len)), SamplingParams(max_new, **kw))


def scheduler_of(running: int, max_seq_len: int, prefill_budget: int, stop_ids=frozenset({EOS}), blocks: int = 64,
                 block_size: int = 4) -> Scheduler:
    return Scheduler(running, max_seq_len, prefill_budget, stop_ids, BlockPool(blocks, block_size))


def step(scheduler: Scheduler, pick=lambda row: 7):
    plan = scheduler.schedule()
    picked = [pick(row) for row in plan.rows if row.sample]
    scheduler.commit(plan, picked)
    return plan


def group(name: str, prompt_len: int, n: int, max_new: int = 4, **kw) -> list[Sequence]:
    first = seq(name, prompt_len, max_new, **kw)
    return [first] + [Sequence(f"{name}#{i}", first.prompt_ids, first.params, fork_of=first) for i in range(1, n)]


def test_prompts_are_prefilled_in_chunks_within_the_budget_while_others_decode():
    scheduler = scheduler_of(4, max_seq_len=64, prefill_budget=8)
    a, b = seq("a", 3, max_new=10), seq("b", 20)
    scheduler.add(a)
    scheduler.add(b)
    plan = step(scheduler)
    assert [(r.start, len(r.tokens), r.sample) for r in plan.rows] == [(0, 3, True), (0, 5, False)]
    plan = step(scheduler)
    # a decodes its first token while b's prompt goes on: 8 rows a step, a's decode row included
    assert [(r.start, len(r.tokens), r.sample) for r in plan.rows] == [(3, 1, True), (5, 7, False)]
    assert plan.prompt_tokens == 7
    plan = step(scheduler)
    # one row short of the budget: b's last token is not left to a row of its own (sequence.prompt_chunk)
    assert [(r.start, len(r.tokens), r.sample) for r in plan.rows] == [(4, 1, True), (12, 6, False)]
    plan = step(scheduler)
    assert [(r.start, len(r.tokens), r.sample) for r in plan.rows] == [(5, 1, True), (18, 2, True)]
    assert b.output == [7] and a.output == [7, 7, 7, 7]
    # each row carries its table as far as its last position (blocks of 4)
    assert [len(r.blocks) for r in plan.rows] == [2, 5] and plan.rows[1].blocks == b.blocks[:5]


def test_prompts_keep_half_the_budget_however_many_sequences_decode():
    scheduler = scheduler_of(8, max_seq_len=64, prefill_budget=8)
    for name in "abcdef":
        scheduler.add(seq(name, 1, max_new=10))
    step(scheduler)  # six one-token prompts: six sequences decoding from here on
    scheduler.add(seq("long", 20))
    assert [len(r.tokens) for r in step(scheduler).rows] == [1] * 6 + [4]


def test_running_is_capped_blocks_are_freed_on_finish_and_cancel_and_waiting_ones_get_them():
    scheduler = scheduler_of(2, max_seq_len=64, prefill_budget=64)
    seqs = [seq(str(i), 2, max_new=3) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    step(scheduler)
    assert (scheduler.running, len(scheduler.waiting), scheduler.pool.used) == (seqs[:2], 2, 2)
    scheduler.cancel(seqs[0])
    assert seqs[0].finish_reason == "cancelled" and scheduler.running == [seqs[1]] and scheduler.pool.used == 1
    step(scheduler)
    assert scheduler.running == [seqs[1], seqs[2]]
    while scheduler.has_work():
        step(scheduler)
    assert [s.finish_reason for s in seqs] == ["cancelled", "length", "length", "length"]
    assert not scheduler.running and scheduler.pool.used == 0


def test_stop_tokens_end_a_sequence_unless_ignored_and_are_not_returned():
    scheduler = scheduler_of(2, max_seq_len=64, prefill_budget=64)
    stops, goes_on = seq("s", 2, max_new=5), seq("g", 2, max_new=3, ignore_eos=True)
    scheduler.add(stops)
    scheduler.add(goes_on)
    script = iter([5, 5, EOS, EOS, 6])
    while scheduler.has_work():
        step(scheduler, pick=lambda row: next(script))
    assert (stops.output, stops.finish_reason) == ([5], "stop")
    assert (goes_on.output, goes_on.finish_reason) == ([5, EOS, 6], "length")


def test_a_sequence_cancelled_while_its_step_runs_is_left_alone():
    scheduler = scheduler_of(1, max_seq_len=64, prefill_budget=64, stop_ids=frozenset())
    a = seq("a", 2)
    scheduler.add(a)
    plan = scheduler.schedule()
    scheduler.cancel(a)
    scheduler.commit(plan, [9])
    assert a.output == [] and a.finish_reason == "cancelled" and scheduler.pool.used == 0


def test_requests_that_cannot_fit_are_refused_before_taking_a_slot():
    scheduler = scheduler_of(1, max_seq_len=16, prefill_budget=8, stop_ids=frozenset())
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        scheduler.add(seq("long", 10, max_new=7))
    with pytest.raises(ValueError, match="prompt is empty"):
        scheduler.add(seq("empty", 0))
    assert not scheduler.has_work()


def test_a_groups_members_take_their_first_tokens_from_one_row_then_decode_and_stop_each_on_its_own():
    scheduler = scheduler_of(8, max_seq_len=64, prefill_budget=4)  # blocks of 4
    a, b, c = members = group("g", 6, 3, max_new=3)
    other = seq("o", 2, max_new=5)
    for s in members + [other]:
        scheduler.add(s)
    plan = step(scheduler)  # 4 of the group's 6 prompt tokens: nobody samples
    assert [(r.start, len(r.tokens), r.sample) for r in plan.rows] == [(0, 4, False)] and plan.pickers == []
    plan = scheduler.schedule()  # the prompt's last 2 tokens, sampled by the three; the other's prompt
    assert [(r.start, len(r.tokens)) for r in plan.rows] == [(4, 2), (0, 2)]
    assert plan.pickers == [members, [other]] and plan.prompt_tokens == 4
    touched = scheduler.commit(plan, [EOS, 5, 6, 9])  # one token per sampler, in order
    assert set(touched) == {a, b, c, other}
    assert (a.output, a.finish_reason, b.output, c.output, other.output) == ([], "stop", [5], [6], [9])
    assert scheduler.running == [b, c, other] and a.blocks == []
    # a's blocks went back but the forks hold the full one; a's partial block, freed before the forks' copies are
    # made, is kept by b in place of its copy (nothing may write it first), and c copies it into its own
    src = plan.rows[0].blocks[1]
    assert b.blocks[1] == src and scheduler.pool.blocks[src].refs == 1 and src not in scheduler.pool.free
    plan = scheduler.schedule()
    assert [(r.start, r.tokens, r.copy) for r in plan.rows] == [(6, [5], None), (6, [6], (src, c.blocks[1])),
                                                             (2, [9], None)]
    assert b.blocks[0] == c.blocks[0] == plan.rows[0].blocks[0] and scheduler.pool.blocks[b.blocks[0]].refs == 2
    scheduler.commit(plan, [EOS, 8, 9])
    assert (b.finish_reason, c.output) == ("stop", [6, 8])
    while scheduler.has_work():
        plan = step(scheduler)
        assert all(r.copy is None for r in plan.rows)  # a copy is made once
    assert (c.output, c.finish_reason, other.finish_reason) == ([6, 8, 7], "length", "length")
    assert scheduler.pool.used == 0


def test_a_groups_first_member_cancelled_while_its_first_tokens_are_picked_hands_the_group_on():
    scheduler = scheduler_of(4, max_seq_len=64, prefill_budget=64)
    a, b, c = members = group("g", 6, 3)
    for s in members:
        scheduler.add(s)
    plan = scheduler.schedule()
    scheduler.cancel(a)  # b carries the group on, in a's place and with its blocks
    assert scheduler.running == [b] and b.forks == [c] and a.blocks == []
    scheduler.commit(plan, [4, 5, 6])  # a's pick is dropped; b is credited with the row it now owns
    assert (a.output, b.output, c.output) == ([], [5], [6]) and b.computed == c.computed == 6
    assert scheduler.running == [b, c] and scheduler.pool.used == 2 + 1


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=96, family="llama3",
                     rope_theta=500000.0, use_scaled_rope=True)
    m = Transformer(args)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    setup_slots(m, 6, 64, torch.float32, torch.device("cpu"))
    return m


@pytest.mark.parametrize("fused", [False, True], ids=["as-loaded", "optimized"])
@torch.inference_mode()
def test_rows_give_the_same_logits_in_any_mix_of_chunks_and_slots(model: Transformer, fused: bool):
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (7, 12, 3, 20)]
    alone = [dense_logits(model, torch.tensor([s]), torch.zeros(1, dtype=torch.long), last_only=False)[0]
             for s in seqs]
    cpu = torch.device("cpu")
    runner = model
    if fused:  # q/k/v and w1/w3 as one matmul each, weights prepared for this CPU's kernels
        runner = copy.deepcopy(model)
        backend.optimize(runner)

    def check(rows, expected):
        got = runner(slot_batch(model, rows, cpu))
        for logits, (s, pos) in zip(got, expected):
            torch.testing.assert_close(logits, alone[s][pos], rtol=1e-4, atol=1e-4)

    # seq 0 and 1 prefilled whole in slots 5 and 2, seq 3's first chunk in slot 3 (no logits wanted)
    check([(5, 0, seqs[0][:6], True), (2, 0, seqs[1], True), (3, 0, seqs[3][:8], False)], [(0, 5), (1, 11)])
    # seq 0 decodes, seq 2 prefilled in slot 0, seq 3's second chunk attends to its first
    check([(5, 6, seqs[0][6:7], True), (0, 0, seqs[2], True), (3, 8, seqs[3][8:], True)], [(0, 6), (2, 2), (3, 19)])
    # decode rows in slots 0, 2 and 5: holes at 1, 3 and 4 between them
    check([(5, 6, seqs[0][6:7], True), (0, 2, seqs[2][2:3], True), (2, 11, seqs[1][11:], True)],
          [(0, 6), (2, 2), (1, 11)])


def test_a_kv_cache_too_big_for_memory_fails_the_load_naming_the_keys(tmp_path):
    from tp_llama.config import EngineConfig
    from tp_llama.engine.core import Engine
    from tp_llama.testing.synthetic import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt", family="llama3", mp=1)
    with pytest.raises(MemoryError, match="lower handler.kv_cache_memory_gb"):
        Engine.load(EngineConfig(str(ckpt), "tp", "float32", max_seq_len=2**16, kv_cache_memory_gb=2**20))
    with pytest.raises(MemoryError, match="cannot hold one sequence of max_seq_len 65536"):
        Engine.load(EngineConfig(str(ckpt), "tp", "float32", max_seq_len=2**16, kv_cache_memory_gb=0.001))


def test_the_plan_comes_back_whole_from_its_wire():
    wire = PlanWire(max_rows=4, max_tokens=16, max_blocks=12)
    plan = StepPlan([Row(7, [5], True, [3, 9], copy=(6, 9)), Row(0, [1, 2, 3], False, [4], decoded=True),
                     Row(32, [8, 9], True, [0, 1, 2], 2, 1, 11), Row(7, [6], True, [3, 0], copy=(6, 0))], end=False)
    assert wire.decode(wire.encode(plan)) == plan and wire.decode(wire.encode(plan)).copies == [(6, 9), (6, 0)]
    assert wire.decode(wire.encode(StepPlan([]))) == StepPlan([])
    with pytest.raises(ValueError, match="exceeds the wire's capacity"):
        wire.encode(StepPlan([Row(0, [1], True, list(range(13)))]))


PLANS = [StepPlan([Row(7, [5], True, [3, 9], copy=(6, 9)), Row(32, [8, 9], True, list(range(10, 21)), 2, 1, 11)]),
         StepPlan([Row(0, [1], True, [4, 5, 6])], end=False), StepPlan([])]


def _exchanged() -> list[StepPlan]:
    """ModelRunner.exchange on this rank, the wire holding 5 block ids: the first plan's other 8 go in a second part."""
    import torch.distributed as dist

    from tp_llama.engine import plan as plan_module
    from tp_llama.engine.runner import ModelRunner
    from tp_llama.parallel.distributed import DistInfo

    plan_module.INLINE_BLOCKS = 5
    rank = dist.get_rank()
    runner = SimpleNamespace(info=DistInfo(rank, 2, rank, torch.device("cpu"), "gloo"),
                             wire=PlanWire(max_rows=4, max_tokens=16, max_blocks=40))
    parts = [len(runner.wire.encode(plan)) for plan in PLANS]
    return [parts, [ModelRunner.exchange(runner, plan if rank == 0 else None) for plan in PLANS]]


def test_a_plan_with_more_blocks_than_its_wire_holds_reaches_every_rank_in_two_parts():
    """Long contexts: the block ids past the wire's room go in a second broadcast, so the wire every step sends
    stays small whatever max_seq_len sizes; rank 1 gets rank 0's plans whole, one part or two."""
    from tp_llama.engine import plan as plan_module

    wire = PlanWire(max_rows=4, max_tokens=16, max_blocks=40)
    assert wire.inline_blocks == min(40, plan_module.INLINE_BLOCKS)
    assert run_ranks(_exchanged, 2, timeout=60) == [[[2, 1, 1], PLANS]] * 2
