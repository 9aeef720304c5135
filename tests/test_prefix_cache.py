"""The paged cache end to end: a prefix-cache hit against the same request run cold, and
sequences preempted when the pool runs dry against the same sequences given room.

A hit prefills fewer rows through other kernels, so its logits are compared within float32
rounding and its greedy tokens exactly; tp mode in process (the KV-cache pages of a hit are the
cold run's own), fsdp mode and TP 2 through the CLI on 2 ranks (tests/support/cli_util.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.cli_util import launch_cli
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.runner import pool_blocks
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.model import Batch
from tp_llama.parallel.distributed import DistInfo

PROMPT = "the keeper climbed the stairs of the lighthouse at dusk and wrote the reading in the log"


@pytest.fixture(scope="module")
def ckpt(synthetic_checkpoint):
    return synthetic_checkpoint("llama3")


@pytest.fixture(scope="module")
def engine(ckpt) -> Engine:
    return Engine.load(EngineConfig(str(ckpt), "tp", "float32", max_seq_len=128, max_batch_size=4))


@torch.inference_mode()
def test_a_hit_prefills_only_the_suffix_and_gives_the_cold_logits(engine: Engine):
    ids = engine.tokenizer.encode(PROMPT, bos=True)
    size, spare, device = engine.cache.block_size, engine.cache.spare, engine.device
    assert len(ids) > 2 * size
    width = -(-len(ids) // size)

    def logits(rows):
        return engine.model(Batch.build(rows, size, spare, device))

    cold = logits([(0, ids, True, list(range(width)))])[0]
    shared = [0, 1]  # the cold run's first two blocks, holding its first 2 * size tokens
    fresh = list(range(width, 2 * width - 2))
    hit = logits([(2 * size, ids[2 * size :], True, shared + fresh)])[0]
    torch.testing.assert_close(hit, cold, rtol=0, atol=1e-4)
    # and the decode step after it, beside the cold sequence's own
    token = int(cold.argmax())
    both = logits([(len(ids), [token], True, list(range(width + 1))), (len(ids), [token], True, shared + fresh + [2 * width])])
    torch.testing.assert_close(both[1], both[0], rtol=0, atol=1e-4)


def generate(engine: Engine, prompts: list[list[int]], max_new: int, one_scheduler: bool = True) -> list[Sequence]:
    """Each prompt after the one before (so later ones find earlier blocks), on one scheduler."""
    scheduler = engine.new_scheduler()
    done = []
    for i, ids in enumerate(prompts):
        seq = Sequence(str(i), ids, SamplingParams(max_new, ignore_eos=True))
        scheduler.add(seq)
        engine.run(scheduler)
        done.append(seq)
        if not one_scheduler:
            scheduler = engine.new_scheduler()
    assert scheduler.pool.used == 0
    return done


def test_greedy_tokens_with_hits_are_those_without(engine: Engine):
    ids = engine.tokenizer.encode(PROMPT, bos=True)
    prompts = [ids, ids, ids + engine.tokenizer.encode(" and slept", bos=False), ids[:20]]
    warm = generate(engine, prompts, 12)
    cold = generate(engine, prompts, 12, one_scheduler=False)
    assert [s.cached_tokens for s in cold] == [0, 0, 0, 0]
    size = engine.cache.block_size
    assert [s.cached_tokens for s in warm] == [0, (len(ids) - 1) // size * size, len(ids) // size * size, size]
    assert [s.output for s in warm] == [s.output for s in cold]


def test_preempted_sequences_finish_with_their_own_tokens(ckpt, engine: Engine):
    cache = engine.cache
    block_bytes = 2 * len(engine.model.layers) * cache.k[:, : cache.block_size].numel() * cache.k.element_size()
    blocks = 128 // cache.block_size + 2  # one sequence of max_seq_len and a little more
    tight = Engine.load(EngineConfig(str(ckpt), "tp", "float32", max_seq_len=128, max_batch_size=4,
                                     kv_cache_memory_gb=blocks * block_bytes / 2**30))
    assert tight.cache.n_blocks == blocks
    words = PROMPT.split()
    prompts = [engine.tokenizer.encode(" ".join(words[i:]), bos=True) for i in range(8, 12)]
    got = []
    for e in (tight, engine):
        sequences = [Sequence(str(i), ids, SamplingParams(40, ignore_eos=True)) for i, ids in enumerate(prompts)]
        e.generate(sequences)
        got.append(sequences)
    assert sum(s.preemptions for s in got[0]) > 0 and sum(s.preemptions for s in got[1]) == 0
    assert [s.output for s in got[0]] == [s.output for s in got[1]]


def cli_tokens(ckpt, world: int, mode: str, extra: list[str]) -> list[dict]:
    prompts = [PROMPT, PROMPT, PROMPT + " and slept"]
    args = ["--ckpt-dir", str(ckpt), "--mode", mode, "--dtype", "float32", "--max-new-tokens", "8", "--slots", "1",
            *extra]
    for prompt in prompts:
        args += ["--prompt", prompt]
    run = launch_cli(args, world, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.strip()]


@pytest.mark.parametrize(("world", "mode"), [(2, "tp"), (2, "fsdp")])
def test_hits_give_the_cold_tokens_in_every_mode(ckpt, world: int, mode: str):
    """--slots 1: each prompt runs after the one before, so the second and third find its blocks."""
    warm = cli_tokens(ckpt, world, mode, [])
    cold = cli_tokens(ckpt, world, mode, ["--no-prefix-caching"])
    assert [r["usage"]["cached_prompt_tokens"] for r in cold] == [0, 0, 0]
    cached = [r["usage"]["cached_prompt_tokens"] for r in warm]
    assert cached[0] == 0 and cached[1] >= 16 and cached[2] >= cached[1]
    assert [r["token_ids"] for r in warm] == [r["token_ids"] for r in cold]


def test_preemption_at_tp2_gives_the_tokens_of_a_roomy_pool(ckpt, engine: Engine):
    """Both ranks follow rank 0's preemptions (the plan carries every row's table)."""
    cache = engine.cache
    per_rank = 2 * len(engine.model.layers) * cache.k[:, : cache.block_size].numel() * cache.k.element_size() // 2
    words = PROMPT.split()
    outputs = []
    for pool in (["--kv-cache-memory-gb", str(10 * per_rank / 2**30)], []):  # 10 blocks: one sequence and two
        args = ["--ckpt-dir", str(ckpt), "--dtype", "float32", "--max-new-tokens", "40", "--ignore-eos",
                "--max-seq-len", "128", "--slots", "4", *pool]
        for i in range(8, 12):
            args += ["--prompt", " ".join(words[i:])]
        run = launch_cli(args, 2, timeout=240)
        assert run.returncode == 0, run.stderr[-3000:]
        outputs.append([json.loads(line) for line in run.stdout.splitlines() if line.strip()])
    tight, roomy = outputs
    assert sum(r["preemptions"] for r in tight) > 0 and sum(r["preemptions"] for r in roomy) == 0
    assert [r["token_ids"] for r in tight] == [r["token_ids"] for r in roomy]


def test_the_gpu_pool_stops_at_four_full_batches_and_where_32_bit_offsets_end(monkeypatch):
    """A small model on an 80 GB GPU had been given 1.4e8 positions: Triton's FlexAttention kernel then
    failed to build (its offsets went past 32 bits). Only the free-memory query is faked here."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 2**30, 80 * 2**30))
    cuda = DistInfo(0, 1, 0, torch.device("cuda", 0), "nccl")
    token_bytes = 2 * 2 * 2 * 64 * 2  # K and V, 2 layers, 2 kv heads of 64, bfloat16
    block_bytes = 16 * token_bytes
    small = EngineConfig("-", max_batch_size=2, max_seq_len=128)
    assert pool_blocks(small, cuda, 2 * 64, block_bytes) == 4 * 2 * 128 // 16
    roomy = EngineConfig("-", max_batch_size=256, max_seq_len=8192)  # 4 batches would be 4 GiB
    assert pool_blocks(roomy, cuda, 2 * 64, block_bytes) == 4 * 256 * 8192 // 16
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 80 * 2**30))
    assert pool_blocks(roomy, cuda, 2 * 64, block_bytes) == int(2**30 * 0.85) // block_bytes
    # A draft model's weights, moved to the GPU after the pool is sized, are left out of the free memory.
    assert pool_blocks(roomy, cuda, 2 * 64, block_bytes, 2**29) == int(2**29 * 0.85) // block_bytes
    asked = EngineConfig("-", kv_cache_memory_gb=1000.0)  # more than 2^31 elements of one layer's keys
    blocks = pool_blocks(asked, cuda, 2 * 64, block_bytes)
    assert (blocks + 1) * 16 * 2 * 64 <= 2**31 < (blocks + 2) * 16 * 2 * 64
