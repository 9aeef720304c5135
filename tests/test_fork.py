"""n > 1 end to end, in process (tp mode, float32, a synthetic checkpoint): a group of sequences of
one prompt computes the prompt once, with prefix caching on or off; every member then decodes as the
same request would alone with seed + its index; the block copy a fork makes holds the prompt's keys and
values; members preempted in a small pool finish with the same tokens; at TP 2 every rank makes the copy.

tests/test_blocks.py checks the scheduler's side of groups (block books at every step, a stand-in KV
cache through the block tables) without the model.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.dist_util import run_ranks
from tp_llama.config import EngineConfig
from tp_llama.engine.blocks import BlockPool
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Scheduler, Sequence

PROMPT = "the keeper climbed the stairs of the lighthouse at dusk and wrote the reading"


def config(ckpt) -> EngineConfig:
    return EngineConfig(str(ckpt), "tp", "float32", max_seq_len=128, max_batch_size=4, prefill_budget=32)


@pytest.fixture(scope="module")
def engine(synthetic_checkpoint) -> Engine:
    return Engine.load(config(synthetic_checkpoint("llama3")))


@pytest.fixture(scope="module")
def prompt(engine: Engine) -> list[int]:
    ids = engine.tokenizer.encode(PROMPT, bos=True)
    assert len(ids) > engine.config.prefill_budget and len(ids) % engine.cache.block_size  # chunked; a partial block
    return ids


def scheduler_of(engine: Engine, caching: bool = True, n_blocks: int | None = None) -> Scheduler:
    c = engine.config
    pool = BlockPool(n_blocks or engine.cache.n_blocks, c.kv_block_size, caching)
    return Scheduler(c.max_batch_size, c.max_seq_len, c.prefill_budget, engine.tokenizer.stop_ids, pool)


def group(prompt: list[int], n: int, params: SamplingParams) -> list[Sequence]:
    first = Sequence("g", list(prompt), params)
    return [first] + [Sequence(f"g#{i}", list(prompt), params, fork_of=first) for i in range(1, n)]


def run(engine: Engine, scheduler: Scheduler, seqs: list[Sequence], on_step=None) -> int:
    """The sequences to their end; returns the prompt tokens the engine computed for them."""
    for s in seqs:
        scheduler.add(s)
    before = engine.stats.prefill_tokens
    engine.run(scheduler, on_step=on_step)
    assert scheduler.pool.used == 0
    return engine.stats.prefill_tokens - before


def alone(engine: Engine, prompt: list[int], params: SamplingParams) -> Sequence:
    s = Sequence("alone", list(prompt), params)
    run(engine, scheduler_of(engine, caching=False), [s])
    return s


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(10, temperature=0.9, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def seeded_alone(engine: Engine, prompt) -> list[list[int]]:
    """The request alone with seeds 11, 12 and 13."""
    return [alone(engine, prompt, sampled(11 + i)).output for i in range(3)]


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
def test_a_group_of_three_computes_its_prompt_once_and_each_decodes_as_it_would_alone(engine: Engine, prompt, caching,
                                                                                     seeded_alone):
    members = group(prompt, 3, sampled(11))
    assert run(engine, scheduler_of(engine, caching), members) == len(prompt)
    assert [s.output for s in members] == seeded_alone
    assert len({tuple(s.output) for s in members}) > 1  # seed + index: not one stream three times
    # the same three as separate requests, in one scheduler: three prompts computed (with prefix caching,
    # the chunks the first had computed before the others were admitted, less)
    apart = [Sequence(str(i), list(prompt), sampled(11 + i)) for i in range(3)]
    computed = run(engine, scheduler_of(engine, caching), apart)
    assert computed > len(prompt) if caching else computed == 3 * len(prompt)
    assert [s.output for s in apart] == seeded_alone


def test_greedy_members_and_prompt_logprobs_computed_once(engine: Engine, prompt):
    params = SamplingParams(8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    members = group(prompt, 3, params)
    assert run(engine, scheduler_of(engine), members) == len(prompt)
    one = alone(engine, prompt, params)
    for s in members:
        assert s.output == one.output and len(s.prompt_logprobs) == len(prompt) - 1
        assert [e.token for e in s.prompt_logprobs] == [e.token for e in one.prompt_logprobs]
        torch.testing.assert_close([e.logprob for e in s.prompt_logprobs], [e.logprob for e in one.prompt_logprobs],
                                   rtol=0, atol=1e-5)
        assert [e.token for e in s.logprobs] == s.output


def test_unseeded_members_draw_from_their_own_seeds(engine: Engine, prompt):
    members = group(prompt, 3, SamplingParams(2, temperature=1.0))
    scheduler = scheduler_of(engine)
    for s in members:
        scheduler.add(s)
    assert len({s.generator.initial_seed() for s in members}) == 3
    engine.run(scheduler)


@torch.inference_mode()
def test_a_forks_copy_of_the_last_prompt_block_holds_the_prompts_keys_and_values(engine: Engine, prompt):
    size = engine.cache.block_size
    caches = [layer.attention.cache for layer in engine.model.layers]
    for cache in caches:  # nothing left of earlier tests in any block
        cache.k.zero_()
        cache.v.zero_()
    members = group(prompt, 2, SamplingParams(3, ignore_eos=True))
    copies, checked = [], []

    def on_step(touched):
        fork, last = members[1], len(prompt) // size
        if fork.copy is not None:  # forked in this step: the copy goes with its next row
            assert fork.copy == (members[0].blocks[last], fork.blocks[last])
            copies.append(fork.copy)
        elif copies and not checked:  # that row ran: the copy was made before it
            src, dst = copies[0]
            written = slice(0, len(prompt) % size)  # the prompt's positions in the block
            for cache in caches:
                for kv in (cache.k, cache.v):
                    blocks = kv.view(kv.shape[0], -1, size, kv.shape[-1])
                    assert blocks[:, src, written].abs().sum() > 0
                    torch.testing.assert_close(blocks[:, dst, written], blocks[:, src, written], rtol=0, atol=0)
            checked.append(True)

    run(engine, scheduler_of(engine), members, on_step)
    assert checked and members[1].output == members[0].output  # greedy: a fork reading a wrong block would part ways


def test_members_preempted_in_a_small_pool_finish_with_the_same_tokens(engine: Engine, prompt):
    params = SamplingParams(24, temperature=0.8, seed=3, ignore_eos=True)  # past the prompt's 5 blocks and 2 more
    blocks = engine.config.max_seq_len // engine.cache.block_size + 2  # one sequence of max_seq_len and a little more
    tight, roomy = group(prompt, 3, params), group(prompt, 3, params)
    run(engine, scheduler_of(engine, n_blocks=blocks), tight)
    run(engine, scheduler_of(engine), roomy)
    assert sum(s.preemptions for s in tight[1:]) > 0 and sum(s.preemptions for s in roomy) == 0
    assert [s.output for s in tight] == [s.output for s in roomy]


def _group_and_alone(ckpt: str) -> tuple[list[list[int]], list[int]]:
    """On every rank: a seeded group of 2, then its fork's request alone (rank 0's outputs count)."""
    engine = Engine.load(config(ckpt))
    prompt = engine.tokenizer.encode(PROMPT[:24], bos=True)  # one step's prompt, its last block partly filled
    assert len(prompt) <= engine.config.prefill_budget and len(prompt) % engine.cache.block_size
    params = lambda seed: SamplingParams(6, temperature=0.9, seed=seed, ignore_eos=True)  # noqa: E731
    members = engine.generate(group(prompt, 2, params(21)))
    return [s.output for s in members], engine.generate([Sequence("alone", list(prompt), params(22))])[0].output


def test_at_tp2_every_rank_makes_the_forks_copy(synthetic_checkpoint):
    """Each rank holds its own KV heads: a rank that skipped the copy would change the fork's logits."""
    (members, alone), _ = run_ranks(_group_and_alone, 2, str(synthetic_checkpoint("llama3")), timeout=120)
    assert members[1] == alone and members[0] != alone
