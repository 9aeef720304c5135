"""The scheduler's slot accounting and plans, and the model running any mix of rows.

The model checks compare a row's logits inside mixed batches (chunked prefill, decode rows with
holes between their slots) with the same sequence run alone in one piece; tests/test_parity.py
compares the whole path with the independent float64 reference.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.run_model import dense_logits
from tp_llama import backend
from tp_llama.model import Batch, Transformer
from tp_llama.model import ModelArgs
from tp_llama.engine.scheduler import SamplingParams, Scheduler, Sequence

EOS = 2


def seq(name: str, prompt_len: int, max_new: int = 4, **kw) -> Sequence:
    return Sequence(name, list(range(10, 10 + prompt_len)), SamplingParams(max_new, **kw))


def step(scheduler: Scheduler, pick=lambda row: 7):
    plan = scheduler.schedule()
    picked = [pick(row) for row in plan.rows if row.sample]
    scheduler.commit(plan, picked)
    return plan


def test_prompts_are_prefilled_in_chunks_within_the_budget_while_others_decode():
    scheduler = Scheduler(slots=4, max_seq_len=64, prefill_budget=8, stop_ids=frozenset({EOS}))
    a, b = seq("a", 3, max_new=10), seq("b", 20)
    scheduler.add(a)
    scheduler.add(b)
    plan = step(scheduler)
    assert [(r.slot, r.start, len(r.tokens), r.sample) for r in plan.rows] == [(0, 0, 3, True), (1, 0, 5, False)]
    plan = step(scheduler)
    # a decodes its first token while b's prompt goes on, 8 tokens at a time
    assert [(r.slot, r.start, len(r.tokens), r.sample) for r in plan.rows] == [(0, 3, 1, True), (1, 5, 8, False)]
    plan = step(scheduler)
    assert [(r.slot, r.start, len(r.tokens), r.sample) for r in plan.rows] == [(0, 4, 1, True), (1, 13, 7, True)]
    assert b.output == [7] and a.output == [7, 7, 7]


def test_slots_are_taken_lowest_first_freed_on_finish_and_cancel_and_waiting_ones_get_them():
    scheduler = Scheduler(slots=2, max_seq_len=64, prefill_budget=64, stop_ids=frozenset({EOS}))
    seqs = [seq(str(i), 2, max_new=3) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    step(scheduler)
    assert (seqs[0].slot, seqs[1].slot, scheduler.busy_slots, len(scheduler.waiting)) == (0, 1, 2, 2)
    scheduler.cancel(seqs[0])
    assert seqs[0].finish_reason == "cancelled" and scheduler.busy_slots == 1
    step(scheduler)
    assert seqs[2].slot == 0 and scheduler.busy_slots == 2
    while scheduler.has_work():
        step(scheduler)
    assert [s.finish_reason for s in seqs] == ["cancelled", "length", "length", "length"]
    assert scheduler.busy_slots == 0 and sorted(scheduler._free) == [0, 1]


def test_stop_tokens_end_a_sequence_unless_ignored_and_are_not_returned():
    scheduler = Scheduler(slots=2, max_seq_len=64, prefill_budget=64, stop_ids=frozenset({EOS}))
    stops, goes_on = seq("s", 2, max_new=5), seq("g", 2, max_new=3, ignore_eos=True)
    scheduler.add(stops)
    scheduler.add(goes_on)
    script = iter([5, 5, EOS, EOS, 6])
    while scheduler.has_work():
        step(scheduler, pick=lambda row: next(script))
    assert (stops.output, stops.finish_reason) == ([5], "stop")
    assert (goes_on.output, goes_on.finish_reason) == ([5, EOS, 6], "length")


def test_a_sequence_cancelled_while_its_step_runs_is_left_alone():
    scheduler = Scheduler(slots=1, max_seq_len=64, prefill_budget=64, stop_ids=frozenset())
    a = seq("a", 2)
    scheduler.add(a)
    plan = scheduler.schedule()
    scheduler.cancel(a)
    scheduler.commit(plan, [9])
    assert a.output == [] and a.finish_reason == "cancelled" and scheduler.busy_slots == 0


def test_requests_that_cannot_fit_are_refused_before_taking_a_slot():
    scheduler = Scheduler(slots=1, max_seq_len=16, prefill_budget=8, stop_ids=frozenset())
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        scheduler.add(seq("long", 10, max_new=7))
    with pytest.raises(ValueError, match="prompt is empty"):
        scheduler.add(seq("empty", 0))
    assert not scheduler.has_work()


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=96, family="llama3",
                     rope_theta=500000.0, use_scaled_rope=True)
    m = Transformer(args)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    m.setup_caches(6, 64, torch.float32, torch.device("cpu"))
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
        got = runner(Batch.build(rows, cpu))
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
    with pytest.raises(MemoryError, match="lower handler.max_batch_size or handler.max_seq_len"):
        Engine.load(EngineConfig(str(ckpt), "tp", "float32", max_seq_len=2**20, max_batch_size=2**20))
