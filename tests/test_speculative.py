"""Speculative decoding (engine/speculate.py, engine/verify.py, the scheduler's rows with proposals):
replies are the same with it on and off, and the KV cache, the block pool and the prefix cache hold
only accepted tokens.

On random weights real proposers are almost always rejected at once, so most tests use a proposer
that replays the reply made without speculation with wrong tokens planted in it: every acceptance
length is exercised, rejection at the first proposal included. Served at TP 2 through TorchServe,
speculation is on in tests/test_serving_e2e.py's tp server, whose replies must equal the offline CLI's.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from tests.support.meta_llama4 import small_params, write_llama4_checkpoint
from tests.support.proposals import Scripted
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.blocks import BlockPool
from tp_llama.engine.plan import PlanWire, Row, StepPlan
from tp_llama.engine.proposal_counts import ProposalCounts
from tp_llama.engine.proposals import step_proposals
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.engine.speculate import LONGEST_WAIT, PROBE_STEPS, NgramIndex, Speculator
from tp_llama.serving.metrics import SPEC_ACCEPTED, SPEC_ACCEPTED_AT, SPEC_DRAFTS, ServingMetrics
from tp_llama.testing.tokenizer_train import build_tokenizer

PROMPTS = {"a": 13, "b": 29, "c": 7, "d": 40}  # name: prompt length (b and d cross a block of 16)
NEW = 24


@pytest.mark.parametrize(("tokens", "k", "expected"), [
    ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),      # "1 2 3" stood earlier: what followed it
    ([5, 1, 2, 7, 7, 1, 2], 2, [7, 7]),         # the longest suffix first ("1 2"), not "2" alone
    ([1, 2, 8, 1, 2, 9, 1, 2], 1, [9]),         # the latest earlier occurrence
    ([4, 5, 6, 7], 3, []),                      # no suffix of 2 or more stands earlier
    ([3, 3, 3, 3], 4, [3]),                     # the run: "3 3 3" at 0 is followed by one 3
    ([1, 2, 1, 2], 5, [1, 2]),                  # fewer than k follow
])
def test_ngram_lookup_proposes_what_followed_the_longest_suffix_seen_before(tokens, k, expected):
    assert NgramIndex(2, 3).propose(tokens, k) == expected


def scanned_proposal(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The lookup by definition: the context scanned back from its end for the longest suffix."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_ngram_index_proposes_what_a_scan_of_the_whole_context_does_as_it_grows():
    """A sequence growing by 1-5 tokens a step (6 token values: many repeats), then replaced by other
    lists (the index starts again), shorter and as long, against the scan at every step."""
    rng = random.Random(0)
    index, tokens = NgramIndex(2, 4), []
    for step in range(400):
        if step in (150, 300):  # not the last list grown: shorter, then as long with other values
            tokens = tokens[:100] if step == 150 else [6 + t for t in tokens]
        tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
        k = rng.randrange(1, 5)
        assert index.propose(tokens, k) == scanned_proposal(tokens, k, 2, 4), step


def waits(speculator: Speculator, seq_id: str, steps: int) -> list[int]:
    """The steps (1-based) of the next `steps` at which the row may propose."""
    return [i + 1 for i in range(steps) if speculator.worth(seq_id)]


def test_a_row_whose_recent_proposals_are_rarely_taken_stops_proposing_and_tries_again():
    """A reply that opens in free text (its proposals rejected) may copy later: switched off, a row proposes
    again after PROBE_STEPS steps, twice as many after each try that fails, and a taken try switches it on."""
    speculator = Speculator(4, 2, 4)
    speculator.record("s", 4, 0)
    assert speculator.worth("s")  # still warming up
    speculator.record("s", 4, 0)
    assert waits(speculator, "s", 3 * PROBE_STEPS) == [PROBE_STEPS, 2 * PROBE_STEPS, 3 * PROBE_STEPS]
    speculator.record("s", 4, 0)  # the try rejected: twice the wait
    assert waits(speculator, "s", 4 * PROBE_STEPS) == [2 * PROBE_STEPS, 4 * PROBE_STEPS]
    for _ in range(10):
        speculator.record("s", 4, 0)
    assert waits(speculator, "s", LONGEST_WAIT) == [LONGEST_WAIT]  # never longer
    speculator.record("s", 2, 2)  # the try taken
    assert waits(speculator, "s", 3) == [1, 2, 3]
    for _ in range(2):  # rejected again: the taken try's weight fades, and the row stops, its wait back at first
        speculator.record("s", 4, 0)
    assert waits(speculator, "s", PROBE_STEPS) == [PROBE_STEPS]
    speculator.record("t", 4, 2)
    speculator.record("t", 4, 1)
    assert speculator.worth("t")
    assert (speculator.proposed, speculator.accepted, speculator.accepted_at) == (70, 5, [3, 2, 0, 0])  # s: 62 / 2, t: 8 / 3
    speculator.forget("s")
    assert speculator.worth("s")


def test_acceptance_per_position_is_counted_under_vllms_position_labels():
    """vLLM labels a row's first proposal position "0" (vllm/v1/spec_decode/metrics.py): its dashboards'
    per-position queries must read the same series here, and the positions add up to the accepted total."""
    speculator = Speculator(4, 2, 4)
    speculator.record("s", 3, 2)
    speculator.record("t", 2, 1)
    metrics = ServingMetrics(None, "llama", 8)
    metrics.speculation(speculator.verified, speculator.proposed, speculator.accepted, speculator.accepted_at)
    metrics.flush()
    per_position = {label: n for (name, label), n in metrics.totals.items() if name == SPEC_ACCEPTED_AT}
    assert per_position == {"0": 2, "1": 1}
    assert sum(per_position.values()) == metrics.totals[(SPEC_ACCEPTED, "")] == 3
    assert metrics.totals[(SPEC_DRAFTS, "")] == 2  # vLLM's mean acceptance length: 1 + accepted / drafts


def simulated_steps(counts: ProposalCounts, rows: int, seconds, p: float, steps: int,
                    swing=lambda step: 1.0) -> list[int]:
    """The counts chosen over `steps` steps of `rows` rows where a step carrying k proposals a row takes
    seconds(rows, k) times swing(step) and each row yields its expected (1 - p^(k+1)) / (1 - p) tokens."""
    chosen = []
    for step in range(steps):
        k = counts.choose(rows)
        counts.observe(rows * (1 - p ** (k + 1)) / (1 - p), seconds(rows, k) * swing(step))
        chosen.append(k)
    return chosen


def test_each_size_of_step_proposes_the_count_its_measured_steps_say_pays():
    """A large model's few rows cost the same whatever they carry (memory-bound): the count climbs to
    the most. Many rows of a small model cost by the token (compute-bound), and a draft's steps on
    top: the count stays at none, tried again only a few steps in every REVISIT."""
    counts = ProposalCounts(4)
    few = simulated_steps(counts, 1, lambda rows, k: 0.010, 0.6, 200)
    many = simulated_steps(counts, 16, lambda rows, k: 0.001 * rows * (1 + k) + 0.002 * k, 0.6, 200)
    assert few[-100:].count(4) >= 90 and few.index(4) < 45  # a trial runs 3 blocks of 4 steps at least
    assert many[-150:].count(0) >= 135
    assert simulated_steps(counts, 1, lambda rows, k: 0.010, 0.6, 10)[-5:] == [4] * 5  # sizes kept apart


def test_counts_are_compared_under_the_same_conditions_while_step_times_swing():
    """Every step's time swings by half within a few dozen steps (contexts, the cores' other work): a
    count measured then beside one measured now would decide by the swing. A trial's two counts take
    turns, so the large model's few rows still climb to the most and the small one's many stay at none."""
    def swing(step: int) -> float:
        return 1 + 0.5 * math.sin(step / 5)

    few = simulated_steps(ProposalCounts(4), 1, lambda rows, k: 0.010, 0.6, 800, swing)
    many = simulated_steps(ProposalCounts(4), 16, lambda rows, k: 0.001 * rows * (1 + k) + 0.002 * k, 0.6, 800, swing)
    assert few[-400:].count(4) >= 380 and many[-400:].count(0) >= 380


def test_a_count_that_loses_a_tenth_is_not_kept_while_step_times_swing_by_a_fifth():
    """Proposals, rarely taken, add a tenth of tokens, and a step carrying any costs a fifth more (a second
    chunk of rows at 4 rows), while each step's time swings at random by a fifth. Trials of four
    steps a count kept a losing count 30% of the time here; trials that run until their blocks agree, 12%."""
    kept = []
    for seed in range(20):
        rng = random.Random(seed)
        chosen = simulated_steps(ProposalCounts(4), 4, lambda rows, k: 0.018 * (1 + 0.2 * (k > 0) + 0.03 * k), 0.1,
                                 1000, lambda step: rng.lognormvariate(0, 0.2))
        kept.append(chosen[-600:].count(0) / 600)
    assert sum(kept) / len(kept) >= 0.85, kept


def test_the_count_follows_a_step_cost_that_moves():
    counts = ProposalCounts(4)
    simulated_steps(counts, 2, lambda rows, k: 0.010, 0.7, 100)
    later = simulated_steps(counts, 2, lambda rows, k: 0.010 * (1 + k), 0.7, 400)  # now every token costs
    assert later[-100:].count(0) >= 85


def test_the_count_follows_rows_that_stop_copying():
    """Many rows copying pay for proposals; the free text after them yields half as much, where none pay.
    Copy's trials have long lost by then (each doubled the wait, up to LONGEST_REVISIT steps), so the
    count must follow the yield that fell, not wait for its next trial."""
    counts = ProposalCounts(4)
    cost = lambda rows, k: 0.010 + 0.001 * rows * (1 + k)  # noqa: E731
    copy = simulated_steps(counts, 16, cost, 0.9, 2000)
    assert copy[-500:].count(0) == 0
    chat = simulated_steps(counts, 16, cost, 0.5, 300)
    assert chat[-150:].count(0) >= 135, chat


def test_the_plan_wire_carries_a_rows_proposals():
    wire = PlanWire(4, 32, 16)
    plan = StepPlan([Row(5, [7, 8, 9], True, [0], proposed=2), Row(0, [1, 2, 3, 4], False, [1])], end=False)
    assert wire.decode(wire.encode(plan)) == plan


class Replay(Scripted):
    """Proposes each sequence's reference continuation, with the tokens at `wrong` positions of the
    output replaced, so proposals are accepted up to a planted token and rejected there. grow: as many as
    the step allows a row (its run of taken proposals doubling), not at most `tokens`."""

    def __init__(self, reference: dict[str, list[int]], wrong: set[int], vocab: int, grow: bool = False):
        super().__init__()
        self.reference, self.wrong, self.vocab, self.grow = reference, wrong, vocab, grow
        self.longest = 0  # the most proposals a row carried

    def propose(self, seq_id: str, tokens, most: int) -> list[int]:
        done = len(tokens) - PROMPTS[seq_id]
        ahead = self.reference[seq_id][done : done + (most if self.grow else min(most, self.tokens))]
        self.longest = max(self.longest, len(ahead))
        return [(t + 1) % self.vocab if done + i in self.wrong else t for i, t in enumerate(ahead)]


@pytest.fixture(scope="module")
def checkpoint(synthetic_checkpoint) -> Path:
    return synthetic_checkpoint("llama3", mp=1)


def requests(engine: Engine, seeded: bool) -> list[Sequence]:
    out = []
    for i, (name, length) in enumerate(PROMPTS.items()):
        ids = torch.randint(3, engine.args.vocab_size, (length,), generator=torch.Generator().manual_seed(i)).tolist()
        params = SamplingParams(NEW, temperature=0.8 if seeded and i % 2 == 0 else 0.0, top_p=0.9, seed=i,
                                logprobs=2, ignore_eos=True, repetition_penalty=1.1 if i == 1 else 1.0)
        out.append(Sequence(name, ids, params))
    return out


def run(engine: Engine, seqs: list[Sequence], speculator: Speculator | None) -> list[Sequence]:
    scheduler = engine.new_scheduler()
    scheduler.speculator = speculator
    for seq in seqs:
        scheduler.add(seq)
    engine.run(scheduler)
    assert len(scheduler.pool.free) == scheduler.pool.n_blocks  # every block back, rejected ones included
    return seqs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_replies_are_the_same_with_proposals_accepted_and_rejected_at_every_length(checkpoint, dtype, seeded):
    assert_proposals_keep_the_replies(checkpoint, dtype, seeded)


@pytest.fixture(scope="module")
def llama4_checkpoint(tmp_path_factory) -> Path:
    """tests/support/meta_llama4.py's small Llama 4: 32-position attention chunks, a NoPE layer, experts."""
    folder = tmp_path_factory.mktemp("llama4")
    write_llama4_checkpoint(folder, small_params(vocab_size=256 + 2048), mp=1)
    build_tokenizer("llama3", folder / "tokenizer.model", 512)  # 256 base tokens, read in Llama 4's format
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama4s_replies_are_the_same_with_proposals_accepted_and_rejected(llama4_checkpoint, dtype):
    """Its verifying rows attend within their chunks, in C on this CPU (backend/llama4.py): d's prompt and
    every reply cross a chunk's end."""
    assert_proposals_keep_the_replies(llama4_checkpoint, dtype, seeded=True)


def assert_proposals_keep_the_replies(checkpoint: Path, dtype: str, seeded: bool) -> None:
    engine = Engine.load(EngineConfig(str(checkpoint), "tp", dtype, max_seq_len=96, max_batch_size=4,
                                      prefill_budget=32))
    plain = run(engine, requests(engine, seeded), None)
    reference = {seq.id: seq.output for seq in plain}
    wrong = {0, 3, 4, 9, 15, 16, 17, 22}  # rejection at the first proposal, after 1, 2, 3 and 4 accepted
    replay = Replay(reference, wrong, engine.args.vocab_size)
    spec = run(engine, requests(engine, seeded), replay)
    for a, b in zip(plain, spec):
        assert b.output == a.output, b.id
        assert b.logprobs == a.logprobs, b.id
    assert replay.proposed > 0 and 0 < replay.accepted < replay.proposed
    assert all(replay.accepted_at), replay.accepted_at  # every position accepted somewhere


def test_runs_of_taken_proposals_grow_across_blocks_and_keep_the_replies(checkpoint):
    """A row whose proposals were all taken carries twice as many next step (a reply copying a passage),
    past the step's count and across block boundaries, within the step's tokens; the replies stay."""
    engine = Engine.load(EngineConfig(str(checkpoint), "tp", "float32", max_seq_len=96, max_batch_size=4,
                                      prefill_budget=64))
    plain = run(engine, requests(engine, False), None)
    replay = Replay({seq.id: seq.output for seq in plain}, {0, 17}, engine.args.vocab_size, grow=True)
    spec = run(engine, requests(engine, False), replay)
    assert [s.output for s in spec] == [s.output for s in plain]
    assert replay.longest >= 8 and len(replay.accepted_at) >= 8 and all(replay.accepted_at)


def test_a_taken_run_doubles_within_the_rows_room_and_a_rejection_ends_it():
    """A row copying a passage (its recent proposals nearly all taken, its last all) doubles its next
    ones; a rejection ends the run, and it grows again only once its recent proposals are mostly taken."""
    speculator = Speculator(4, 2, 4)
    speculator.record("s", 3, 3)
    assert speculator.row_most("s", 3) == 6 and speculator.row_most("s", 8) == 8
    speculator.record("s", 6, 6)
    assert speculator.row_most("s", 3) == 12
    speculator.record("s", 12, 7)
    assert speculator.row_most("s", 3) == 3 and speculator.row_most("t", 3) == 3
    assert speculator.accepted_at == [3, 3, 3, 2, 2, 2, 1]
    for _ in range(4):  # taken, but a tenth of its recent proposals or more rejected: free text, not a copy
        speculator.record("s", 3, 3)
        assert speculator.row_most("s", 3) == 3
    pattern = list(range(10, 50))
    seq = Sequence("s", pattern * 2, SamplingParams(64))
    seq.output, seq.computed = pattern[:5], 2 * len(pattern) + 4  # its newest token not yet in the cache
    pool = BlockPool(64, 16)
    seq.blocks = pool.allocate(pool.blocks_for(seq.computed))
    speculator.record("s", 3, 3)  # the fifth: its recent proposals mostly taken again
    proposals, _ = step_proposals([seq], 3, 31, pool, speculator, 512)
    assert proposals == [pattern[5:11]]
    assert step_proposals([seq], 3, 4, pool, speculator, 512)[0] == [pattern[5:9]]  # the step's spare
    seq.params = SamplingParams(8)
    assert step_proposals([seq], 3, 31, pool, speculator, 512)[0] == [pattern[5:7]]  # max_tokens
    speculator.draft = object()  # each of a draft's proposals costs a draft step: its rows never grow
    assert speculator.row_most("s", 3) == 3


def test_preemption_and_a_small_pool_keep_the_replies(checkpoint):
    """A pool so small that sequences are preempted while they speculate, proposals cut to the blocks
    left, rows crossing block boundaries."""
    roomy = Engine.load(EngineConfig(str(checkpoint), "tp", "float32", max_seq_len=96, max_batch_size=4,
                                     prefill_budget=32))
    reference = {seq.id: seq.output for seq in run(roomy, requests(roomy, True), None)}
    cache = roomy.cache
    block_bytes = 2 * len(roomy.model.layers) * cache.k[:, : cache.block_size].numel() * cache.k.element_size()
    tight = Engine.load(EngineConfig(str(checkpoint), "tp", "float32", max_seq_len=96, max_batch_size=4,
                                     prefill_budget=32, kv_cache_memory_gb=8 * block_bytes / 2**30))
    scheduler = tight.new_scheduler()
    scheduler.speculator = Replay(reference, {2, 7, 11}, tight.args.vocab_size)
    seqs = requests(tight, True)
    for seq in seqs:
        scheduler.add(seq)
    tight.run(scheduler)
    assert scheduler.preemptions > 0
    assert {seq.id: seq.output for seq in seqs} == reference


def cached_keys(engine: Engine, seq: Sequence, positions: int) -> torch.Tensor:
    size = engine.cache.block_size
    where = [seq.blocks[p // size] * size + p % size for p in range(positions)]
    return torch.stack([layer.attention.cache.k[:, where] for layer in engine.model.layers])


def test_the_cache_holds_the_accepted_sequence_and_the_prefix_cache_no_rejected_token(checkpoint):
    engine = Engine.load(EngineConfig(str(checkpoint), "tp", "float32", max_seq_len=96, max_batch_size=4,
                                      prefill_budget=32))
    snapshots = {}

    def after(seq: Sequence, label: str):
        def on_step(_) -> None:
            if label not in snapshots and len(seq.output) >= 12:
                snapshots[label] = cached_keys(engine, seq, seq.computed)
        return on_step

    def one(speculator: Speculator | None, label: str) -> Sequence:
        seq = requests(engine, False)[1]
        scheduler = engine.new_scheduler()
        scheduler.speculator = speculator
        scheduler.add(seq)
        engine.run(scheduler, on_step=after(seq, label))
        return seq

    plain = one(None, "plain")
    one(Replay({"b": plain.output}, {1, 5, 6, 10}, engine.args.vocab_size), "spec")
    shared = min(snapshots["plain"].shape[2], snapshots["spec"].shape[2])
    assert shared >= PROMPTS["b"] + 11
    assert torch.equal(snapshots["plain"][..., :shared, :], snapshots["spec"][..., :shared, :])
    # A new request over the speculating sequence's tokens reads its cached blocks: the continuation
    # must be what a fresh engine (nothing cached) computes.
    follow = plain.prompt_ids + plain.output[:20]
    scheduler = engine.new_scheduler()
    scheduler.speculator = Replay({"b": plain.output}, {1, 5, 6, 10}, engine.args.vocab_size)
    spec = Sequence("b", plain.prompt_ids, requests(engine, False)[1].params)
    scheduler.add(spec)
    engine.run(scheduler)
    again = Sequence("again", follow, SamplingParams(6, ignore_eos=True))
    scheduler.speculator = None
    scheduler.add(again)
    engine.run(scheduler)
    assert again.cached_tokens and again.cached_tokens >= 32
    fresh = Engine.load(EngineConfig(str(checkpoint), "tp", "float32", max_seq_len=96, max_batch_size=4,
                                     prefill_budget=32, prefix_caching=False))
    expected = Sequence("again", follow, SamplingParams(6, ignore_eos=True))
    fresh.generate([expected])
    assert again.output == expected.output


def test_a_reply_ending_in_taken_proposals_leaves_its_blocks_to_the_next_turn(checkpoint):
    """A reply whose last step takes a run of proposals (and reaches max_tokens there): the blocks that run
    filled join the prefix cache as a reply's blocks do without speculation, so the chat's next turn reads as
    many cached positions either way (they were left out, and the next turn computed them again)."""
    engine = Engine.load(EngineConfig(str(checkpoint), "tp", "float32", max_seq_len=96, max_batch_size=4,
                                      prefill_budget=64))
    reference = {"b": run(engine, [requests(engine, False)[1]], None)[0].output}

    def next_turn_cached(speculator: Speculator | None) -> int:
        seq, scheduler = requests(engine, False)[1], engine.new_scheduler()
        scheduler.speculator = speculator
        scheduler.add(seq)
        engine.run(scheduler)
        assert seq.output == reference["b"]
        scheduler.speculator = None
        follow = Sequence("next", seq.prompt_ids + seq.output + [7], SamplingParams(2, ignore_eos=True))
        scheduler.add(follow)
        engine.run(scheduler)
        return follow.cached_tokens

    replay = Replay(reference, set(), engine.args.vocab_size, grow=True)
    assert next_turn_cached(replay) == next_turn_cached(None) == (PROMPTS["b"] + NEW) // 16 * 16
    assert replay.longest >= 8


def test_proposals_stop_at_max_tokens_and_the_ngram_proposer_runs_through_the_yaml_setting(checkpoint):
    engine = Engine.load(EngineConfig(str(checkpoint), "tp", "float32", max_seq_len=640, max_batch_size=4,
                                      prefill_budget=128, speculative="ngram", speculative_tokens=3, ngram_min=1))
    scheduler = engine.new_scheduler()
    assert isinstance(scheduler.speculator, Speculator) and scheduler.speculator.tokens == 3
    # Every id of the vocabulary stands in the prompt, so every token drawn after it has a 1-gram proposal.
    every = torch.randperm(engine.args.vocab_size, generator=torch.Generator().manual_seed(5)).tolist()
    seqs = [Sequence("short", every, SamplingParams(5, ignore_eos=True)),
            Sequence("long", every[1:], SamplingParams(NEW, ignore_eos=True))]
    plain = [Sequence(s.id, s.prompt_ids, s.params) for s in seqs]
    for seq in seqs:
        scheduler.add(seq)
    engine.run(scheduler)
    assert scheduler.speculator.proposed > 0
    run(engine, plain, None)
    assert [s.output for s in seqs] == [s.output for s in plain] and len(seqs[0].output) == 5
    with pytest.raises(ValueError, match="ngram_min"):
        EngineConfig(str(checkpoint), ngram_min=5, ngram_max=3)
