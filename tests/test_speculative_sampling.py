"""Speculative decoding leaves the sampled distribution as it is: over many seeded draws of one prompt,
the joint histogram of a reply's tokens 2 to K + 1 (the positions its first decode step verifies; token 1
comes from prefill and is never speculated) is the same with proposals as without, by a two-sample
chi-square test, and a planted bug (on a rejection, emit the proposal) fails that test.

Sampling keeps the top 3 tokens at temperature 1, so each position has few outcomes of non-trivial
probability (the synthetic checkpoint's full vocabulary is nearly flat) and the cells fill. Draws with
and without proposals use disjoint seeds: one random number per emitted token makes same-seed replies
identical (checked apart), which would pass any test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from tp_llama.config import EngineConfig
from tp_llama.engine import core
from tp_llama.engine.core import Engine
from tp_llama.engine.plan import Row
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.engine.speculate import Speculator
from tp_llama.engine.verify import verify_rows

PROMPT = [5, 17, 99, 230]
K = 2  # proposals a reply's first decode step carries: they stand at its tokens 2 .. K + 1
DRAWS = 1500  # replies a sample
BATCH = 10  # decode rows whose K proposals each fit the 32 tokens of a step (SPECULATE_STEP_TOKENS)
TOP_K, TEMPERATURE = 3, 1.0
LEVEL = 1e-3  # the chi-square test's significance


class Greedy(Speculator):
    """Proposes, after a reply's first token, the greedy continuation of the prompt and that token, so that
    proposals are the likeliest tokens, taken often but far from always."""

    def __init__(self, ahead: dict[int, list[int]]):
        super().__init__(K, 1, 1)
        self.ahead = ahead

    def worth(self, seq_id: str) -> bool:
        return True

    def per_row(self, rows: int) -> int:
        return self.tokens  # K whatever the steps cost

    def propose(self, seq_id: str, tokens: list[int], most: int) -> list[int]:
        return self.ahead.get(tokens[-1], [])[:most] if len(tokens) == len(PROMPT) + 1 else []


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One CPU thread: the model is tiny, and thousands of steps on two threads slow down manyfold
    whenever another process holds a core (each step's threads wait on the busy one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine(synthetic_checkpoint) -> Engine:
    return Engine.load(EngineConfig(str(synthetic_checkpoint("llama3", mp=1)), "tp", "float32", max_seq_len=16,
                                    max_batch_size=64, prefill_budget=256))


def draw(engine: Engine, seeds: range, speculator: Speculator | None) -> list[list[int]]:
    """Each seed's reply of K + 2 tokens (room for K proposals after the first); with proposals BATCH at
    a time, since a step beside a waiting prompt carries none."""
    scheduler = engine.new_scheduler()
    scheduler.speculator = speculator
    params = [SamplingParams(K + 2, temperature=TEMPERATURE, top_k=TOP_K, seed=s, ignore_eos=True) for s in seeds]
    seqs = [Sequence(str(i), list(PROMPT), p) for i, p in enumerate(params)]
    batch = BATCH if speculator is not None else len(seqs)
    for start in range(0, len(seqs), batch):
        for seq in seqs[start : start + batch]:
            scheduler.add(seq)
        engine.run(scheduler)
    return [seq.output for seq in seqs]


def greedy(engine: Engine) -> Greedy:
    """The proposer, its continuations read off greedy replies after each of the prompt's top tokens."""
    first = Sequence("first", list(PROMPT), SamplingParams(1, logprobs=TOP_K, ignore_eos=True))
    engine.generate([first])
    after = {t: Sequence(str(t), PROMPT + [t], SamplingParams(K, ignore_eos=True)) for t, _ in first.logprobs[0].top}
    engine.generate(list(after.values()))
    return Greedy({t: seq.output for t, seq in after.items()})


def homogeneity_p(a: Counter, b: Counter, least: float = 5.0) -> float:
    """The two-sample chi-square test's p-value over the cells of a and b, those expected fewer than
    `least` times in either sample pooled into one, so that the chi-square approximation holds."""
    na, nb = sum(a.values()), sum(b.values())
    cells = [(a[c], b[c]) for c in set(a) | set(b)]
    kept = [cell for cell in cells if sum(cell) * min(na, nb) / (na + nb) >= least]
    pooled = [cell for cell in cells if sum(cell) * min(na, nb) / (na + nb) < least]
    if pooled:
        kept.append((sum(x for x, _ in pooled), sum(y for _, y in pooled)))
    stat = 0.0
    for x, y in kept:
        for observed, n in ((x, na), (y, nb)):
            expected = (x + y) * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    df = torch.tensor((len(kept) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


def joint(replies: list[list[int]]) -> Counter:
    return Counter(tuple(reply[1 : K + 1]) for reply in replies)


@pytest.fixture(scope="module")
def plain(engine: Engine) -> Counter:
    return joint(draw(engine, range(DRAWS), None))


def test_same_seed_replies_are_identical_with_and_without_proposals(engine: Engine):
    speculator = greedy(engine)
    assert draw(engine, range(40), speculator) == draw(engine, range(40), None)
    assert 0 < speculator.accepted < speculator.proposed


def test_the_joint_histogram_of_verified_tokens_passes_a_chi_square_test(engine: Engine, plain: Counter):
    speculator = greedy(engine)
    p = homogeneity_p(plain, joint(draw(engine, range(DRAWS, 2 * DRAWS), speculator)))
    print(f"\nno bug: p = {p:.4g}, {speculator.accepted} of {speculator.proposed} proposals accepted "
          f"(by position {speculator.accepted_at}), {len(plain)} cells")
    assert 0.2 < speculator.accepted / speculator.proposed < 0.8  # both outcomes exercised, many times
    assert min(speculator.accepted_at) > 0.1 * DRAWS  # the second proposal too
    assert p > LEVEL


def emit_proposal_on_rejection(logits: torch.Tensor, rows: list[Row], groups: list[list], allowed: torch.Tensor | None,
                               constrained: list[int]) -> tuple[list[int], list, dict[int, list]]:
    """verify_rows with the planted bug: a row whose proposals were not all accepted emits the one
    rejected in place of the token drawn there."""
    picked, logprobs, verified = verify_rows(logits, rows, groups, allowed, constrained)
    first = 0  # the sampling row's first sampler in `picked` (a row with proposals has exactly one)
    for i, group in zip([i for i, row in enumerate(rows) if row.sample], groups):
        accepted = len(verified.get(i, []))
        if accepted < rows[i].proposed:
            picked[first] = rows[i].tokens[1 + accepted]
        first += len(group)
    return picked, logprobs, verified


def test_emitting_the_proposal_on_a_rejection_fails_the_chi_square_test(engine: Engine, plain: Counter,
                                                                        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(core, "verify_rows", emit_proposal_on_rejection)
    speculator = greedy(engine)
    p = homogeneity_p(plain, joint(draw(engine, range(DRAWS, 2 * DRAWS), speculator)))
    print(f"\nplanted bug: p = {p:.4g}, {speculator.accepted} of {speculator.proposed} proposals accepted")
    assert speculator.proposed > 0.9 * DRAWS * K  # the bug had its chances
    assert p < LEVEL
