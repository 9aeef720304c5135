"""Speculative decoding with a draft model (engine/draft.py): replies are the same with it on and off,
the draft's KV cache follows its sequences through rejections, block boundaries and preemptions, and
a draft of another vocabulary is refused at load.

A draft that is the served checkpoint itself computes exactly the served model's greedy tokens where
its KV cache holds what the sequence holds, so every proposal must be taken: a stale or misplaced
draft entry shows as a rejection. Served at TP 2 through TorchServe, tests/test_serving_e2e.py's tp
server drafts with its own checkpoint as a second one, and its replies must equal the offline CLI's;
the int4 self-draft runs at TP 2 through the CLI here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.draft import Drafter
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.engine.speculate import Speculator
from tp_llama.errors import CheckpointError

from tests.support.cli_util import launch_cli
from tests.test_blocks import KV, SIZE, alone, forward, scheduler_of

LENGTHS = (5, 17, 33, 14)  # prompts; 17 and 33 cross a block of 16
NEW = 40


@pytest.fixture(scope="module")
def checkpoint(synthetic_checkpoint) -> Path:
    return synthetic_checkpoint("llama3", mp=1)


def settings(ckpt: Path, **extra) -> EngineConfig:
    return EngineConfig(str(ckpt), max_seq_len=96, max_batch_size=4, prefill_budget=32, **extra)


def replies(engine: Engine, seeded: bool = False) -> tuple[list[list[int]], object]:
    """Each prompt's reply (every block back in the pool at the end), and the run's scheduler. Rows
    propose all they may: on these tiny shapes a draft step costs what a served one does, and the
    cost rule would keep proposals to the one a row it tries."""
    scheduler = engine.new_scheduler()
    if scheduler.speculator is not None:
        scheduler.speculator.per_row = lambda rows: engine.config.speculative_tokens
    seqs = []
    for i, length in enumerate(LENGTHS):
        ids = torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(i)).tolist()
        params = SamplingParams(NEW, temperature=0.9 if seeded and i % 2 else 0.0, seed=i, ignore_eos=True)
        seqs.append(Sequence(str(i), ids, params))
        scheduler.add(seqs[-1])
    engine.run(scheduler)
    assert len(scheduler.pool.free) == scheduler.pool.n_blocks
    return [seq.output for seq in seqs], scheduler


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("blocks", [0, 14], ids=["roomy", "preempting"])
def test_a_draft_that_is_the_served_checkpoint_has_every_proposal_taken(checkpoint, dtype, blocks):
    """The small pool (14 blocks of 16 for four sequences of up to 73 tokens) preempts sequences mid-reply
    and leaves rows fewer blocks than proposals."""
    # A block's keys and values: 2 layers x 4 heads x 16 positions x 16 wide, the served model's and the draft's.
    pool_gb = blocks * 2 * 2 * 2 * 4 * 16 * 16 * torch.finfo(getattr(torch, dtype)).bits // 8 / 2**30
    plain, _ = replies(Engine.load(settings(checkpoint, dtype=dtype, kv_cache_memory_gb=pool_gb)))
    engine = Engine.load(settings(checkpoint, dtype=dtype, kv_cache_memory_gb=pool_gb, speculative="draft",
                                  draft_ckpt_dir=str(checkpoint)))
    drafted, scheduler = replies(engine)
    assert drafted == plain
    speculator = scheduler.speculator
    assert speculator.proposed > 40 and speculator.accepted == speculator.proposed
    assert all(speculator.accepted_at)
    assert (scheduler.preemptions > 0) == (blocks > 0)


def test_a_prompt_longer_than_a_draft_step_is_fed_to_the_draft_whole(checkpoint):
    """A sequence alone whose first draft feed (its prompt and first token) passes the step's budget: the
    feed's first chunk samples nothing, and must still be written to the draft's KV cache, so the served
    checkpoint as its draft has every proposal taken."""
    config = settings(checkpoint, dtype="float32", speculative="draft", draft_ckpt_dir=str(checkpoint))
    engine = Engine.load(config)
    scheduler = engine.new_scheduler()
    scheduler.speculator.per_row = lambda rows: config.speculative_tokens
    ids = torch.randint(3, 500, (2 * config.prefill_budget + 5,), generator=torch.Generator().manual_seed(7)).tolist()
    seq = Sequence("long", ids, SamplingParams(12, ignore_eos=True))
    scheduler.add(seq)
    engine.run(scheduler)
    speculator = scheduler.speculator
    assert len(seq.output) == 12 and speculator.proposed > 0
    assert speculator.accepted == speculator.proposed


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_the_int4_self_draft_keeps_the_replies(checkpoint, seeded):
    """The self-draft reads and writes the served model's own KV cache: a wrong entry left there would change
    the replies."""
    plain, _ = replies(Engine.load(settings(checkpoint, dtype="bfloat16")), seeded)
    drafted, scheduler = replies(Engine.load(settings(checkpoint, dtype="bfloat16", speculative="draft")), seeded)
    assert drafted == plain
    speculator = scheduler.speculator
    assert 0 < speculator.accepted < speculator.proposed  # int4 rounding flips some of random weights' near ties


def test_a_smaller_draft_of_the_same_tokenizer_keeps_the_replies(checkpoint, synthetic_checkpoint):
    small = synthetic_checkpoint("llama3", mp=2, n_layers=1, dim=64, n_heads=4, n_kv_heads=2, seed=3)
    plain, _ = replies(Engine.load(settings(checkpoint, dtype="float32")))
    drafted, scheduler = replies(Engine.load(settings(checkpoint, dtype="float32", speculative="draft",
                                                      draft_ckpt_dir=str(small))))
    assert drafted == plain and scheduler.speculator.proposed > 0


def test_a_draft_of_another_vocabulary_is_refused_at_load(checkpoint, synthetic_checkpoint):
    other = synthetic_checkpoint("llama2", mp=1)
    with pytest.raises(CheckpointError, match="draft's vocabulary") as error:
        Engine.load(settings(checkpoint, speculative="draft", draft_ckpt_dir=str(other)))
    assert str(other / "tokenizer.model") in str(error.value) and str(checkpoint / "tokenizer.model") in str(error.value)


def test_a_self_draft_whose_tp_slices_split_int4_groups_fails_the_load_naming_the_draft(synthetic_checkpoint):
    """The llama2 shape's ffn (352) splits into TP 2 slices of 176, which groups of 32 do not divide."""
    run = launch_cli(["--ckpt-dir", str(synthetic_checkpoint("llama2", mp=2)), "--speculative", "draft", "--prompt", "a"],
                     2, timeout=120)
    assert run.returncode != 0
    assert "the draft (this checkpoint at int4, speculative: draft)" in run.stderr and "groups of 32" in run.stderr


@pytest.mark.parametrize(("extra", "message"), [
    ({"quantize": "int4"}, "already serves"),
    ({"mode": "fsdp"}, "needs mode 'tp'"),
    ({"draft_ckpt_dir": 7}, "draft_ckpt_dir must be"),
])
def test_draft_settings_that_cannot_work_are_refused(checkpoint, extra, message):
    with pytest.raises(ValueError, match=message):
        settings(checkpoint, speculative="draft", **extra)


def test_the_int4_self_draft_at_tp_2_through_the_cli_keeps_the_replies(synthetic_checkpoint):
    """Two ranks, each drafting with its int4 slices into its own slice of the served KV cache, the draft's
    plans broadcast beside the served model's."""
    ckpt = synthetic_checkpoint("llama3", mp=2, multiple_of=64)  # ffn 384: TP 2 slices keep whole int4 groups
    args = ["--ckpt-dir", str(ckpt), "--dtype", "bfloat16", "--max-new-tokens", "24", "--ignore-eos",
            "--prompt", "the lamp", "--prompt", "a keeper wrote the reading in the log at dusk"]
    outputs = []
    for extra in ([], ["--speculative", "draft"]):
        run = launch_cli([*args, *extra], 2, timeout=180)
        assert run.returncode == 0, run.stderr[-3000:]
        outputs.append([json.loads(line)["token_ids"] for line in run.stdout.splitlines() if line.strip()])
    assert "KV cache: the served model's" in run.stderr
    assert len(outputs[0]) == 2 and outputs[1] == outputs[0]
    timings = json.loads(run.stdout.splitlines()[0])["timings"]
    assert 0 < timings["accepted_tokens"] <= timings["proposed_tokens"], timings


def served(scheduler, plan) -> list[int]:
    """tests/test_blocks.py's stand-in step, every proposal rejected (the rows' proposals left out)."""
    rows = [dataclasses.replace(row, tokens=row.tokens[: len(row.tokens) - row.proposed], proposed=0)
            for row in plan.rows]
    return forward(scheduler, dataclasses.replace(plan, rows=rows))


def test_a_forks_copy_whose_source_went_back_is_not_overwritten_by_the_self_draft_first():
    """A group's first sequence stops at its first token, so the block its fork is to copy (the prompt's last,
    partly filled one) goes back to the pool before the copy is made; the next step's proposals of another row
    take it, and the self-draft, which writes the served KV cache, writes them before that step's copies. The
    fork must still read its own prompt (tests/test_blocks.py's stand-in model asserts each row's history)."""
    scheduler = scheduler_of(5, max_seq_len=20)

    def self_draft(rows):  # writes its rows into the served cache, as the int4 self-draft does; proposes 9
        kv = KV.setdefault(scheduler, {})
        for row in rows:
            for p, token in enumerate(row.tokens, row.start):
                kv[row.blocks[p // SIZE] * SIZE + p % SIZE] = token
        return torch.nn.functional.one_hot(torch.full((sum(row.sample for row in rows),), 9), 100).float()

    scheduler.speculator = Speculator(8, 1, 1, draft=Drafter(self_draft, 100, frozenset({2}), 64, SIZE, True))
    scheduler.speculator.per_row = lambda rows: 8
    other = Sequence("other", [10, 11, 12], SamplingParams(16))
    scheduler.add(other)
    plan = scheduler.schedule()
    scheduler.commit(plan, served(scheduler, plan))
    first = Sequence("g", [20, 21, 22, 23, 24, 25], SamplingParams(8))
    fork = Sequence("g#1", list(first.prompt_ids), first.params, fork_of=first)
    scheduler.add(first)
    scheduler.add(fork)
    plan = scheduler.schedule()
    picked = served(scheduler, plan)
    assert [[s.id for s in pickers] for pickers in plan.pickers] == [["other"], ["g", "g#1"]]
    scheduler.commit(plan, [picked[0], 2, picked[2]])  # the first stops; its fork goes on
    assert first.finish_reason == "stop"
    while scheduler.has_work():
        plan = scheduler.schedule()
        scheduler.commit(plan, served(scheduler, plan))
    assert scheduler.speculator.proposed > 0
    assert fork.output == alone(fork.prompt_ids, 8) and other.output == alone(other.prompt_ids, 16)
    assert scheduler.pool.used == 0
