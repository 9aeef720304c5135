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

import json
from pathlib import Path

import pytest
import torch

from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.errors import CheckpointError

from tests.support.cli_util import launch_cli

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
