"""A row's bits do not depend on its batch: with the C kernels, a whole forward's logits of a row alone
equal (torch.equal) the same row at every position of a batch of mixed lengths, and an engine's
prompt and reply log-probabilities of a request alone equal those of the same request beside others.

Run for the build this CPU loads, and again for every lesser build it can execute and with
ATen held to AVX2 (tests/test_kernels.py reruns this module with TP_LLAMA_KERNELS and
ATEN_CPU_CAPABILITY). That they can fail: a build whose short chunks of rows sum k backwards fails
them (`TP_LLAMA_KERNELS_TEST_DEFINES=-DTPL_TEST_REMAINDER_ORDER pytest tests/test_batch_invariance.py`:
9 failed, 7 passed when it was written).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tp_llama import backend
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams, top_logits
from tp_llama.engine.scheduler import Sequence
from tp_llama.kernels import choose
from tp_llama.kernels.cpu import ops
from tp_llama.model import ModelArgs, Transformer
from tests.support.meta_llama4 import random_served, small_params
from tests.support.run_model import setup_slots, slot_batch

pytestmark = pytest.mark.skipif(choose(torch.device("cpu"), torch.float32)[0] not in ("amx", "tiles"),
                                reason="the C kernels need AVX2 or AVX-512 and a compiler (test_kernels checks they load here)")

VOCAB = 97
SLOTS = 7
MAX_SEQ_LEN = 256
# (slot, tokens already in its cache, tokens of this step): decode rows after 7 and 19 tokens (the
# second's key in its second block), prompts from 0 of lengths that are no multiple of a tile's
# rows (3, 4, 8) or of a block, a later chunk of a prompt, a first token alone, and a long prompt
# that makes the step 256 rows or more (where float32 had run oneDNN's GEMM).
ROWS = [(0, 7, 1), (1, 19, 1), (2, 0, 5), (3, 0, 13), (4, 9, 11), (5, 0, 1), (6, 0, 227)]


def model(dtype: torch.dtype, head_dim: int, quantized: str) -> Transformer:
    """A small GQA Llama 3.1 model with SLOTS cache slots, the same weights every call, prepared for
    the C kernels (head_dim 64: bfloat16 prompts take prompt_attention.c's blocks; 16: decode rows')."""
    torch.manual_seed(0)
    args = ModelArgs(dim=4 * head_dim, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_dim=96,
                     family="llama3", rope_theta=500000.0, use_scaled_rope=True)
    built = Transformer(args).to(dtype)
    assert backend.optimize(built, quantized=quantized)[0] in ("amx", "tiles")
    setup_slots(built, SLOTS, MAX_SEQ_LEN, dtype, torch.device("cpu"))
    return built


def tokens_of(slot: int, count: int) -> list[int]:
    gen = torch.Generator().manual_seed(100 + slot)
    return torch.randint(0, VOCAB, (count,), generator=gen).tolist()


def with_history(built: Transformer, rows: list[tuple[int, int, int]] = ROWS) -> Transformer:
    """The model with each row's earlier tokens in its cache, each prefilled in a step of its own."""
    for slot, done, _ in rows:
        if done:
            built(slot_batch(built, [(slot, 0, tokens_of(slot, done), True)]))
    return built


def step_rows(order: list[int], rows: list[tuple[int, int, int]] = ROWS) -> list[tuple[int, int, list[int], bool]]:
    return [(rows[i][0], rows[i][1], tokens_of(rows[i][0], rows[i][1] + rows[i][2])[rows[i][1]:], True) for i in order]


def per_row(logits: torch.Tensor, order: list[int], rows: list[tuple[int, int, int]] = ROWS) -> dict[int, torch.Tensor]:
    """Every token's logits of a step (all_logits, the caller's row order), by row of `rows`."""
    return dict(zip(order, logits.split([rows[i][2] for i in order])))


def assert_alone_equals_batched(make: Callable[[], Transformer], rows: list[tuple[int, int, int]]) -> None:
    """Each row's logits alone equal (torch.equal) its logits at every place of a batch of all `rows`."""
    alone_model, batched_model = (with_history(make(), rows) for _ in range(2))
    alone = {i: alone_model(slot_batch(alone_model, step_rows([i], rows), all_logits=True)) for i in range(len(rows))}
    for shift in range(len(rows)):  # each row at each place of the batch
        order = [(i + shift) % len(rows) for i in range(len(rows))]
        step = batched_model(slot_batch(batched_model, step_rows(order, rows), all_logits=True))
        batched = per_row(step, order, rows)
        for i, logits in batched.items():
            assert torch.equal(logits, alone[i]), f"row {rows[i]} at place {order.index(i)} of {order}"
            lse, ids, values = top_logits(logits, list(range(len(logits))), 5)
            lse_alone, ids_alone, values_alone = top_logits(alone[i], list(range(len(logits))), 5)
            assert torch.equal(lse, lse_alone) and torch.equal(ids, ids_alone) and torch.equal(values, values_alone)


CASES = [(torch.float32, 16, "none"), (torch.float32, 64, "none"), (torch.bfloat16, 16, "none"),
         (torch.bfloat16, 64, "none"), (torch.float32, 16, "int8"), (torch.bfloat16, 64, "int8"),
         (torch.float32, 64, "int4"), (torch.bfloat16, 16, "int4")]


@pytest.mark.parametrize(("dtype", "head_dim", "quantized"), CASES,
                         ids=[f"{str(d)[6:]}-hd{h}-{q}" for d, h, q in CASES])
@torch.inference_mode()
def test_a_rows_logits_alone_equal_it_at_every_place_of_a_mixed_batch(dtype, head_dim, quantized):
    assert_alone_equals_batched(lambda: model(dtype, head_dim, quantized), ROWS)


# Llama 4 (tests/support/meta_llama4.py's small model: 32-position chunks, a NoPE layer, experts): decode rows
# at a chunk's last position, its first, and past the first chunk; a later prompt chunk across a chunk's end.
LLAMA4_ROWS = [(0, 7, 1), (1, 31, 1), (2, 32, 1), (3, 40, 1), (4, 0, 13), (5, 9, 30), (6, 0, 1)]
LLAMA4_CASES = [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 64)]


def llama4_model(dtype: torch.dtype, head_dim: int) -> Transformer:
    """The small Llama 4 with random weights on the C kernels (heads of 64: bfloat16 prompts in prompt_attention.c)."""
    built = random_served(small_params(vocab_size=VOCAB, dim=8 * head_dim), dtype, SLOTS, 96)
    assert all(layer.attention.in_c for layer in built.layers)
    return built


@pytest.mark.parametrize(("dtype", "head_dim"), LLAMA4_CASES, ids=[f"{str(d)[6:]}-hd{h}" for d, h in LLAMA4_CASES])
@torch.inference_mode()
def test_a_llama4_rows_logits_alone_equal_it_at_every_place_of_a_mixed_batch(dtype, head_dim):
    """Its attention (chunked or global, after PyTorch's RoPE, QK-norm and temperature) runs in C, decode rows
    within their windows, prompt chunks a piece per window; PyTorch's padded the decode rows to the longest,
    and a row's bits moved with its batch."""
    assert_alone_equals_batched(lambda: llama4_model(dtype, head_dim), LLAMA4_ROWS)


@torch.inference_mode()
def test_a_llama4_bfloat16_prompt_in_prompt_attentions_blocks_gets_the_same_bits_however_it_is_chunked():
    """A prompt across two windows' ends, whole and in chunks that start and end inside windows."""
    prompt = tokens_of(9, 70)
    one_step, chunked = (llama4_model(torch.bfloat16, 64) for _ in range(2))
    whole = one_step(slot_batch(one_step, [(0, 0, prompt, True)], all_logits=True))
    parts = torch.cat([chunked(slot_batch(chunked, [(0, start, prompt[start:end], True)], all_logits=True))
                       for start, end in ((0, 7), (7, 40), (40, 70))])
    assert torch.equal(whole, parts)


ROW_PATH = [(torch.float32, 16), (torch.float32, 64), (torch.bfloat16, 16)]


@pytest.mark.parametrize(("dtype", "head_dim"), ROW_PATH, ids=[f"{str(d)[6:]}-hd{h}" for d, h in ROW_PATH])
@torch.inference_mode()
def test_a_prompt_prefilled_in_one_step_gets_the_bits_of_its_tokens_decoded_one_by_one(dtype, head_dim):
    """Where prompt tokens attend as decode rows (all but bfloat16 heads of 64 and more), a prompt's
    logits at every position are those of feeding its tokens one per step, however it is chunked."""
    prompt = tokens_of(9, 21)
    one_step, chunked, one_by_one = (model(dtype, head_dim, "none") for _ in range(3))
    whole = one_step(slot_batch(one_step, [(0, 0, prompt, True)], all_logits=True))
    parts = torch.cat([chunked(slot_batch(chunked, [(0, start, prompt[start:end], True)], all_logits=True))
                       for start, end in ((0, 6), (6, 17), (17, 21))])
    decoded = torch.cat([one_by_one(slot_batch(one_by_one, [(0, p, [prompt[p]], True)])) for p in range(len(prompt))])
    assert torch.equal(whole, decoded) and torch.equal(parts, decoded)


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 16), (torch.bfloat16, 64)], ids=["f32-hd16", "bf16-hd64"])
@torch.inference_mode()
def test_a_row_verifying_proposals_gets_the_bits_of_decoding_them_one_by_one(dtype, head_dim):
    """Speculative decoding's rows (logits at several positions) attend as decode rows even where
    prompts take prompt_attention.c's blocks, beside a prompt chunk and a decode row."""
    prompt, ahead = tokens_of(9, 21), tokens_of(10, 5)
    verifying, decoding = (model(dtype, head_dim, "none") for _ in range(2))
    for built in (verifying, decoding):
        built(slot_batch(built, [(0, 0, prompt, True), (1, 0, prompt[:7], True)]))
    rows = [(0, len(prompt), ahead, len(ahead)), (1, 7, [3], True), (2, 0, prompt[:18], True)]
    verified = verifying(slot_batch(verifying, rows))[: len(ahead)]
    one_by_one = torch.cat([decoding(slot_batch(decoding, [(0, len(prompt) + i, [t], True)])) for i, t in enumerate(ahead)])
    assert torch.equal(verified, one_by_one)


@torch.inference_mode()
def test_a_bfloat16_prompt_in_prompt_attentions_blocks_gets_the_same_bits_however_it_is_chunked():
    """prompt_attention.c (bfloat16, heads of 64) groups a chunk's rows in blocks of 16 from the
    chunk's start: a row's bits must not depend on which block, or which chunk, holds it."""
    prompt = tokens_of(9, 40)
    one_step, chunked = (model(torch.bfloat16, 64, "none") for _ in range(2))
    whole = one_step(slot_batch(one_step, [(0, 0, prompt, True)], all_logits=True))
    parts = torch.cat([chunked(slot_batch(chunked, [(0, start, prompt[start:end], True)], all_logits=True))
                       for start, end in ((0, 7), (7, 30), (30, 40))])
    assert torch.equal(whole, parts)


@pytest.fixture(scope="module")
def checkpoint(synthetic_checkpoint):
    return synthetic_checkpoint("llama3", mp=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engines_log_probabilities_of_a_request_alone_equal_them_beside_others(checkpoint, dtype):
    """Prompt log-probabilities (echo, perplexity) and the reply's, alone and beside requests of other
    lengths that share its steps (its prompt then chunked elsewhere by the prefill budget)."""
    engine = Engine.load(EngineConfig(str(checkpoint), "tp", dtype, max_seq_len=128, max_batch_size=8,
                                      prefill_budget=24, prefix_caching=False))

    def request(name: str, length: int, seed: int) -> Sequence:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, engine.args.vocab_size, (length,), generator=gen).tolist()
        return Sequence(name, ids, SamplingParams(6, temperature=1.0, seed=seed, logprobs=5, prompt_logprobs=5,
                                                  ignore_eos=True))

    alone = request("alone", 29, 1)
    engine.generate([alone])
    beside = request("beside", 29, 1)
    engine.generate([request("a", 11, 2), beside, request("b", 37, 3), request("c", 1, 4)])
    assert beside.output == alone.output
    assert beside.prompt_logprobs == alone.prompt_logprobs
    assert beside.logprobs == alone.logprobs


@pytest.fixture(scope="module")
def heads_of_64(synthetic_checkpoint):
    return synthetic_checkpoint("llama3", mp=1, dim=256, n_heads=4, n_kv_heads=2)


@pytest.mark.skipif(not ops.blocked_prompts(torch.bfloat16, 64), reason="prompt_attention.c runs no prompt here")
@pytest.mark.parametrize("length, before", [(7, 26), (3, 30)])
def test_a_bfloat16_prompt_the_budget_would_cut_one_token_short_keeps_its_reply(heads_of_64, length, before):
    """bfloat16 with heads of 64 (prompt_attention.c): a 7-token prompt beside one of 26 tokens in a budget of 32
    would leave its last token to a row of its own, which attends as a decode row, with other bits; its seeded
    reply and log-probabilities are those it gets alone. A 3-token prompt beside one of 30 has a budget of 2,
    which can take no fewer than 2 and not be alone: it waits for the next step."""
    engine = Engine.load(EngineConfig(str(heads_of_64), "tp", "bfloat16", max_seq_len=64, max_batch_size=4,
                                      prefill_budget=32, prefix_caching=False))

    def reply(before: int) -> Sequence:
        seq = Sequence("x", tokens_of(1, length), SamplingParams(8, temperature=0.9, seed=1, logprobs=3,
                                                                ignore_eos=True))
        others = [Sequence("y", tokens_of(2, before), SamplingParams(4, ignore_eos=True))] if before else []
        engine.generate([*others, seq])
        return seq

    alone, beside = reply(0), reply(before)
    assert (beside.output, beside.logprobs) == (alone.output, alone.logprobs)


@pytest.mark.skipif(not ops.blocked_prompts(torch.bfloat16, 64), reason="prompt_attention.c runs no prompt here")
def test_a_bfloat16_prompt_after_a_cache_hit_gets_no_lone_token_from_the_budgets_last_one(heads_of_64):
    """bfloat16 with heads of 64, prefix caching on: a 40-token prompt hitting its first two blocks, beside a prompt
    of 31 in a budget of 32, was handed the last one: its position 32 in a row of its own attended as a decode row,
    with other bits than its prompt row alone gives it, and its seeded reply changed."""
    engine = Engine.load(EngineConfig(str(heads_of_64), "tp", "bfloat16", max_seq_len=64, max_batch_size=4,
                                      prefill_budget=32))

    def reply(before: int) -> Sequence:
        scheduler = engine.new_scheduler()  # the prefix cache's, filled with the prompt's first two blocks
        scheduler.add(Sequence("warm", tokens_of(1, 40), SamplingParams(1, ignore_eos=True)))
        engine.run(scheduler)
        seq = Sequence("x", tokens_of(1, 40), SamplingParams(8, temperature=0.9, seed=1, logprobs=3, ignore_eos=True))
        for other in [Sequence("y", tokens_of(2, before), SamplingParams(4, ignore_eos=True))] if before else []:
            scheduler.add(other)
        scheduler.add(seq)
        engine.run(scheduler)
        assert seq.cached_tokens == 32 and scheduler.pool.used == 0
        return seq

    alone, beside = reply(0), reply(31)
    assert (beside.output, beside.logprobs) == (alone.output, alone.logprobs)


def preempted_and_roomy(ckpt, lengths: list[int], blocks: int, prefix_caching: bool) -> None:
    """Seeded replies to prompts of `lengths` from a pool of `blocks` blocks, where some are preempted, equal a
    roomy pool's, tokens and log-probabilities, and every block is back at the end."""

    def replies(engine: Engine) -> list[Sequence]:
        seqs = [Sequence(str(i), tokens_of(i, n), SamplingParams(30, temperature=0.9, seed=i, logprobs=3,
                                                                 ignore_eos=True)) for i, n in enumerate(lengths)]
        scheduler = engine.new_scheduler()
        for seq in seqs:
            scheduler.add(seq)
        engine.run(scheduler)
        assert scheduler.pool.used == 0
        return seqs

    config = dict(max_seq_len=64, max_batch_size=4, prefill_budget=32, prefix_caching=prefix_caching)
    roomy = Engine.load(EngineConfig(str(ckpt), "tp", "bfloat16", **config))
    cache = roomy.cache
    block_bytes = 2 * len(roomy.model.layers) * cache.k[:, : cache.block_size].numel() * cache.k.element_size()
    tight = Engine.load(EngineConfig(str(ckpt), "tp", "bfloat16", kv_cache_memory_gb=blocks * block_bytes / 2**30,
                                     **config))
    assert tight.cache.n_blocks == blocks
    want, got = replies(roomy), replies(tight)
    assert sum(s.preemptions for s in want) == 0 and sum(s.preemptions for s in got) > 0
    assert [(s.output, s.logprobs) for s in got] == [(s.output, s.logprobs) for s in want]


@pytest.mark.skipif(not ops.blocked_prompts(torch.bfloat16, 64), reason="prompt_attention.c runs no prompt here")
def test_a_bfloat16_reply_preempted_and_computed_again_keeps_its_tokens_and_log_probabilities(heads_of_64):
    """bfloat16 with heads of 64: a sequence preempted mid-reply computes its reply's tokens again as decode rows
    (`Row.decoded`), with the bits the decode steps gave their keys and values; computed as a prompt (in
    prompt_attention.c) they had other bits, and what it drew after them could differ."""
    preempted_and_roomy(heads_of_64, [9, 14, 19, 24], 6, prefix_caching=False)  # one of max_seq_len, two blocks more


@pytest.mark.skipif(not ops.blocked_prompts(torch.bfloat16, 64), reason="prompt_attention.c runs no prompt here")
def test_a_bfloat16_reply_preempted_and_readmitted_on_its_own_cached_block_keeps_its_tokens(heads_of_64):
    """bfloat16 with heads of 64, prefix caching on: a preempted sequence of a 17-token prompt, readmitted, hits its
    own first block; computing only its prompt's last token then, in a row of its own, attends it as a decode row,
    with other bits than its prompt row gave it (prompt_attention.c), and the reply changed (at its 28th token)."""
    preempted_and_roomy(heads_of_64, [33, 17, 17, 17], 8, prefix_caching=True)
