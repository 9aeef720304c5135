"""The batched sampler against the plain definition, written here in float64 with a full sort.

Distributions are checked statistically on small vocabularies (every filter, penalty and bias,
ties at the boundaries); at Llama 3's 128,256 tokens the draw is checked exactly, with fixed
uniforms, for the C kernel and for the PyTorch bisection that other devices run. A seeded
request draws the same tokens alone and batched where the logits are batch-invariant.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import pytest
import torch

from tp_llama.cli import generate
from tp_llama.cli.generate import parse_args
from tp_llama.engine import sampling
from tp_llama.engine.sampling import (
    SamplingParams,
    _penalize_in_c,
    _top_in_c,
    apply_masks,
    check_params,
    draw_by_bisection,
    sample_rows,
    top_logits,
)
from tp_llama.engine.sampling import penalize as torch_penalize
from tp_llama.kernels.cpu import ffi

HAS_C = ffi.load()[0] is not None


@dataclass
class Row:
    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)


def penalized(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """A row's logits after its logit_bias and penalties, by the definitions in the docs, in float64, in vLLM's order
    (its logit_bias is a logits processor, run before its penalties)."""
    p = row.params
    x = logits.double().clone()
    for token, bias in p.logit_bias:
        x[token] += bias
    if p.repetition_penalty != 1:
        for token in set(row.prompt_ids + row.output):
            x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(row.output):
        x[token] -= p.frequency_penalty * row.output.count(token) + p.presence_penalty
    return x


def reference(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """The probability of every token, by the definitions in the docs, in float64."""
    p = row.params
    x = penalized(logits, row)
    if p.temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(), len(x)).double()
    probs = torch.softmax(x / p.temperature, dim=0)
    keep = probs >= p.min_p * probs.max()
    if 0 < p.top_k < keep.sum():
        kth = x[keep].sort(descending=True).values[p.top_k - 1]
        keep &= x >= kth
    if p.top_p < 1:
        kept = probs * keep
        ascending, order = x.sort()
        from_top = torch.cat([kept[order].flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])
        above = from_top[torch.searchsorted(ascending, x, right=True)]  # kept mass of tokens with higher logits
        keep &= above < p.top_p * kept.sum()
    final = probs * keep
    return final / final.sum()


def reference_draw(distribution: torch.Tensor, uniform: float) -> int:
    return int(torch.searchsorted(distribution.cumsum(0), torch.tensor([uniform], dtype=torch.float64),
                                  right=True).clamp(max=len(distribution) - 1))


# Logits with ties at the boundaries the filters draw: tokens 2 and 3 tie, 5, 6 and 7 tie.
SMALL = torch.tensor([2.0, 1.5, 1.0, 1.0, 0.3, 0.0, 0.0, 0.0, -0.5, -1.0, -3.0, -8.0])
CASES = {
    "temperature": SamplingParams(1, temperature=0.7),
    "top_p": SamplingParams(1, temperature=1.0, top_p=0.8),
    "top_p-tie": SamplingParams(1, temperature=1.0, top_p=0.62),
    "top_k-tie": SamplingParams(1, temperature=1.3, top_k=3),
    "top_k-top_p": SamplingParams(1, temperature=1.0, top_k=6, top_p=0.9),
    "min_p": SamplingParams(1, temperature=1.0, min_p=0.2),
    "all-filters": SamplingParams(1, temperature=0.9, top_k=8, top_p=0.95, min_p=0.05),
    "penalties": SamplingParams(1, temperature=1.0, frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.5),
    "logit_bias": SamplingParams(1, temperature=1.0, logit_bias=((11, 9.0), (0, -100.0))),
}
HISTORY = {"prompt_ids": [1, 4, 4, 9], "output": [0, 0, 2, 5]}


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    rows = [Row(params, torch.Generator().manual_seed(seed * 100_000 + i), **HISTORY) for i in range(n)]
    tokens, _ = sample_rows(logits.expand(n, -1).contiguous(), rows)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double() / n


@pytest.mark.parametrize("name", list(CASES))
def test_draws_follow_the_definition(name: str):
    params = CASES[name]
    want = reference(SMALL, Row(params, **HISTORY))
    got = draws(SMALL, params, 6000)
    assert torch.all(got[want == 0] == 0), f"{name}: drew a filtered token: {got} vs {want}"
    tolerance = 5 * (want * (1 - want) / 6000).sqrt() + 1e-9
    assert torch.all((got - want).abs() <= tolerance), f"{name}:\n got  {got}\n want {want}"


def test_the_pytorch_draw_follows_the_definition_too(device: str):
    """draw_by_bisection is what CUDA and CPUs without the C kernels run (on --device here)."""
    for name in ("top_p-tie", "top_k-tie", "all-filters"):
        params = CASES[name]
        want = reference(SMALL, Row(params))
        gen = torch.Generator().manual_seed(5)
        uniforms = torch.rand(4000, dtype=torch.float64, generator=gen).tolist()
        logits = SMALL.expand(4000, -1).contiguous().to(device)
        picked = draw_by_bisection(logits, list(range(4000)), [params] * 4000, uniforms)
        assert picked.device == logits.device
        got = torch.bincount(picked.cpu(), minlength=len(SMALL)).double() / 4000
        assert torch.all(got[want == 0] == 0) and torch.all((got - want).abs() <= 5 * (want * (1 - want) / 4000).sqrt())


@pytest.mark.parametrize("case", ["signed-zero-top_k", "signed-zero-top_p", "nan"])
def test_the_pytorch_draw_keeps_equal_logits_together_and_never_draws_nan(case: str, device: str):
    """-0.0 and +0.0 are equal logits, tied at a boundary as sample.c ties them; a NaN logit is never
    drawn and leaves the others' distribution as it is, as in sample.c (its weight is 0)."""
    logits, params = {
        "signed-zero-top_k": ([1.0, 0.0, -0.0, 0.0, -2.0], SamplingParams(1, temperature=1.0, top_k=2)),
        "signed-zero-top_p": ([1.0, -0.0, 0.0, -2.0], SamplingParams(1, temperature=1.0, top_p=0.75)),
        "nan": ([1.0, math.nan, 0.5, -2.0], SamplingParams(1, temperature=1.0)),
    }[case]
    finite = torch.tensor([-math.inf if math.isnan(v) else v for v in logits])
    want = reference(finite, Row(params))
    uniforms = [(i + 0.5) / 64 for i in range(64)]
    x = torch.tensor(logits).expand(64, -1).contiguous()
    expected = [reference_draw(want, u) for u in uniforms]
    assert draw_by_bisection(x.to(device), list(range(64)), [params] * 64, uniforms).tolist() == expected
    if HAS_C:
        assert sampling._draw_in_c(x, list(range(64)), [params] * 64, uniforms).tolist() == expected


def test_greedy_rows_take_penalties_and_bias_too():
    row = Row(SamplingParams(1, repetition_penalty=2.0), prompt_ids=[4, 9], output=[0])  # token 0: 2.0 -> 1.0
    assert sample_rows(SMALL.unsqueeze(0).clone(), [row])[0] == [1]
    row = Row(SamplingParams(1, frequency_penalty=0.3, presence_penalty=0.1), output=[0, 0])  # 2.0 - 0.7
    assert sample_rows(SMALL.unsqueeze(0).clone(), [row])[0] == [1]
    row = Row(SamplingParams(1, logit_bias=((10, 6.0),)))
    assert sample_rows(SMALL.unsqueeze(0).clone(), [row])[0] == [10]
    row = Row(SamplingParams(1))
    assert sample_rows(SMALL.unsqueeze(0).clone(), [row])[0] == [0]


VOCAB = 128_256


@pytest.mark.parametrize("path", ["c", "torch"])
def test_penalties_at_llama3s_vocabulary_are_the_definitions(path: str):
    """Both penalty paths (the C pass on CPU, PyTorch's indexed ops elsewhere) against the float64
    definitions: tokens recurring in prompt and output, a bias on a penalized token, a row without
    penalties between penalized ones, and each row the same whatever was penalized before it."""
    if path == "c" and not HAS_C:
        pytest.skip("tp_llama's C kernels do not run here (test_kernels checks that they do where they can)")
    penalize = _penalize_in_c if path == "c" else torch_penalize
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    history = torch.randint(0, VOCAB, (300,), generator=gen).tolist()
    prompt, output = history[:200] + [7, 7, 9], history[150:300] + [7, 9, 9, 9, 11]  # overlapping, repeated
    rows = [Row(SamplingParams(1, temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.45, presence_penalty=0.2,
                               logit_bias=((9, 2.5), (VOCAB - 1, -4.0))), prompt_ids=prompt, output=output),
            Row(SamplingParams(1, temperature=0.7), prompt_ids=prompt, output=output),
            Row(SamplingParams(1, frequency_penalty=-0.7), prompt_ids=prompt, output=output),
            Row(SamplingParams(1, repetition_penalty=0.8, logit_bias=((11, -1.0),)), prompt_ids=prompt, output=[])]
    got = penalize(logits, rows)
    assert not torch.equal(got, logits) and torch.equal(got[1], logits[1])
    for r, row in enumerate(rows):
        assert torch.allclose(got[r].double(), penalized(logits[r], row), rtol=0, atol=2e-6), r
    again = penalize(logits[2:], rows[2:])  # after the rows above, and on its own
    assert torch.equal(again, got[2:])


@pytest.mark.parametrize("path", ["c", "torch"])
def test_logit_bias_comes_before_the_repetition_penalty_as_in_vllm(path: str, monkeypatch):
    """vLLM's sampler runs logit_bias (a logits processor) before its penalties, so the repetition penalty divides
    or multiplies the biased logit: token 1, -1 + 3 = 2 > 0, is divided by 4 (0.5) and is the greedy pick; the
    bias added after the penalty gave -1 * 4 + 3 = -1, and token 0 (0.3)."""
    if path == "c" and not HAS_C:
        pytest.skip("tp_llama's C kernels do not run here (test_kernels checks that they do where they can)")
    if path == "torch":
        monkeypatch.setattr(sampling, "in_c", lambda logits: False)
    raw = [0.3, -1.0, 0.2, 2.0]
    params = SamplingParams(1, repetition_penalty=4.0, presence_penalty=0.5, logit_bias=((1, 3.0), (3, -1.0)))
    row = Row(params, prompt_ids=[1, 3], output=[3])
    want = [0.3, (-1.0 + 3.0) / 4.0, 0.2, (2.0 - 1.0) / 4.0 - 0.5]  # bias, repetition, then presence
    got = (_penalize_in_c if path == "c" else torch_penalize)(torch.tensor([raw]), [row])
    assert got[0].tolist() == pytest.approx(want, abs=1e-6)
    assert sample_rows(torch.tensor([raw]), [row])[0] == [want.index(max(want))] == [1]


@pytest.mark.parametrize("path", ["c", "torch"])
def test_a_tiny_repetition_penalty_makes_its_tokens_certain_not_infinite(path: str):
    """1e-40 (inside the API's range) divides a positive logit past float32's range: it stops at the largest
    float, so the draw is among the penalized positive tokens, on both sampling paths, with finite log-probabilities
    (an inf drew token 0 and made them NaN)."""
    if path == "c" and not HAS_C:
        pytest.skip("tp_llama's C kernels do not run here (test_kernels checks that they do where they can)")
    penalize = _penalize_in_c if path == "c" else torch_penalize
    logits = torch.tensor([[2.0, 1.5, -1.0, 0.5, 3.0, 0.25]])
    params = SamplingParams(1, temperature=1.0, repetition_penalty=1e-40)
    got = penalize(logits, [Row(params, prompt_ids=[3, 5, 2])])
    biggest = torch.finfo(torch.float32).max
    tiny = torch.tensor(1e-40).item()  # as float32 holds it
    assert got[0].tolist() == [2.0, 1.5, -tiny, biggest, 3.0, biggest]
    uniforms = [0.01, 0.3, 0.49, 0.51, 0.7, 0.99]
    draws = [draw_by_bisection(got, [0], [params], [u]).item() for u in uniforms]
    assert draws == [3, 3, 3, 5, 5, 5]
    if HAS_C:
        assert [sampling._draw_in_c(got, [0], [params], [u]).item() for u in uniforms] == draws
    lse, _, values = top_logits(got, [0], 2)
    assert math.isfinite(lse.item()) and (values.double() - lse).tolist() == [[0.0, 0.0]]  # log 2 below lse's ulp


@pytest.mark.skipif(not HAS_C, reason="needs tp_llama's C kernels")
def test_a_token_id_outside_the_vocabulary_is_refused_by_the_c_penalties():
    row = Row(SamplingParams(1, repetition_penalty=1.2), prompt_ids=[1, len(SMALL)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _penalize_in_c(SMALL.unsqueeze(0), [row])
    fine = Row(SamplingParams(1, repetition_penalty=2.0), prompt_ids=[0])  # the marks left clean by the refusal
    assert _penalize_in_c(SMALL.unsqueeze(0), [fine])[0, 0] == 1.0


def big_logits(rows: int, seed: int) -> torch.Tensor:
    """Half the rows peaked (a few hundred likely tokens, as a trained model gives), half nearly flat."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen)
    logits[::2] *= 2.5
    return logits


def first_largest(row: list[float]) -> int:
    """argmax written plainly: the first NaN, else the first of the largest."""
    nans = [i for i, v in enumerate(row) if math.isnan(v)]
    return nans[0] if nans else row.index(max(row))


def test_greedy_rows_take_the_first_of_the_largest_logits():
    """Greedy rows of sample_rows (the C pass on CPU where it builds) against argmax written plainly:
    ties, rows all below zero of a width that is no multiple of 16, NaN, infinities of both signs."""
    inf, nan = math.inf, math.nan
    rows = [[1.0, 3.0, 3.0, 2.0], [-5.0] * 16 + [-2.0, -3.0, -2.0], [-1.0] * 19, [0.0, nan, 5.0, nan],
            [-inf, inf, 2.0, inf], [-inf] * 17, [1.0, 2.0, inf, -inf, nan]]
    width = max(len(r) for r in rows)
    for row in rows:  # one row at a time, at its own width, and all rows padded with -inf beside each other
        assert sample_rows(torch.tensor([row]), [Row(SamplingParams(1))])[0] == [first_largest(row)]
    padded = [row + [-inf] * (width - len(row)) for row in rows]
    assert sample_rows(torch.tensor(padded), [Row(SamplingParams(1)) for _ in rows])[0] == [first_largest(r) for r in padded]
    logits = big_logits(33, seed=5)
    logits[3, 77] = logits[3, 128_000] = logits[3].max() + 1  # a tie at Llama 3's width
    tokens, _ = sample_rows(logits, [Row(SamplingParams(1)) for _ in range(33)])
    assert tokens == logits.argmax(-1).tolist() and tokens[3] == 77


@pytest.mark.parametrize("path", ["c", "torch"])
def test_a_temperature_below_1e_5_is_greedy_on_every_path(path: str, monkeypatch):
    """docs/api.md: any temperature below 1e-5 is greedy (vLLM's), for the engine and the CLI too, not only
    the API's parsing: 1 / 1e-39 overflows float32 in sample.c, and 1e-46 rounds to 0 in the bisection's
    column, and both drew token 0 (every weight NaN or 0) rather than the most likely token."""
    if path == "c" and not HAS_C:
        pytest.skip("tp_llama's C kernels do not run here (test_kernels checks that they do where they can)")
    if path == "torch":
        monkeypatch.setattr(sampling, "in_c", lambda logits: False)
    rows = [[0.5, 3.0, 1.0, 3.0], [-2.0, -1.0, -7.0, -1.5], [4.0] + [-1.0] * 16 + [9.0, 2.0]]
    for temperature in (1e-6, 1e-30, 1e-39, 1e-46):
        for row in rows:
            params = SamplingParams(1, temperature=temperature, top_p=0.5, logprobs=0)
            tokens, logprobs = sample_rows(torch.tensor([row]), [Row(params, torch.Generator().manual_seed(1))])
            assert tokens == [first_largest(row)], (temperature, row, tokens)
            assert math.isfinite(logprobs[0].logprob)


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("top_k", [4, 2**63, 2**64 + 1])
def test_a_top_k_of_the_vocabulary_or_more_is_no_limit(path: str, top_k: int, monkeypatch):
    """check_params takes any k >= 0 (the CLI's --top-k): one of the vocabulary or more keeps every token (docs/api.md),
    where k past int64 wrapped to 1 in sample.c's struct (the argmax only) and failed the bisection's tensor."""
    if path == "c" and not HAS_C:
        pytest.skip("tp_llama's C kernels do not run here (test_kernels checks that they do where they can)")
    if path == "torch":
        monkeypatch.setattr(sampling, "in_c", lambda logits: False)
    raw = [0.5, 3.0, 1.0, 2.9]
    weights = [math.exp(v - max(raw)) for v in raw]
    cdf = [sum(weights[: t + 1]) / sum(weights) for t in range(len(raw))]  # every token kept, in token order
    params = SamplingParams(1, temperature=1.0, top_k=top_k)
    check_params(params)
    drawn = set()
    for seed in range(40):
        u = float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
        got = sample_rows(torch.tensor([raw]), [Row(params, torch.Generator().manual_seed(seed))])[0]
        want = [next(t for t in range(len(raw)) if cdf[t] > u)]
        assert got == want, (u, got, want)
        drawn.update(got)
    assert drawn == {0, 1, 2, 3}  # the draws reached every token, the least likely too


@pytest.mark.parametrize("path", ["c", "bisection"])
def test_at_llama3s_vocabulary_the_draw_is_exactly_the_definitions(path: str):
    if path == "c" and not HAS_C:
        pytest.skip("tp_llama's C kernels do not run here (test_kernels checks that they do where they can)")
    settings = [SamplingParams(1, temperature=0.6, top_p=0.9), SamplingParams(1, temperature=1.0, top_k=50),
                SamplingParams(1, temperature=0.8, min_p=0.05, top_p=0.95), SamplingParams(1, temperature=1.0)]
    n = 16
    logits = big_logits(n, seed=1)
    params = [settings[r // 2 % len(settings)] for r in range(n)]  # each setting on a peaked and a flat row
    # The row's one uniform, from a seed chosen so that it lies in the top half: draws that reach the
    # tail, where a filter left out would show.
    seeds = [next(s for s in range(1000 * r, 1000 * (r + 1))
                  if float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(s))) > 0.5)
             for r in range(n)]
    uniforms = [float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(s))) for s in seeds]
    if path == "c":
        got = sample_rows(logits, [Row(p, torch.Generator().manual_seed(s)) for p, s in zip(params, seeds)])[0]
    else:
        got = draw_by_bisection(logits, list(range(n)), params, uniforms).tolist()
    want = [reference_draw(reference(logits[r], Row(params[r])), uniforms[r]) for r in range(n)]
    assert got == want


def test_logprobs_are_those_of_the_raw_logits():
    logits = big_logits(3, seed=4)
    rows = [Row(SamplingParams(1, temperature=0.5, repetition_penalty=1.8, logprobs=5), torch.Generator().manual_seed(1),
                prompt_ids=[3, 7]),
            Row(SamplingParams(1, logprobs=0)),
            Row(SamplingParams(1))]
    tokens, logprobs = sample_rows(logits, rows)
    exact = torch.log_softmax(logits.double(), dim=-1)
    for r in (0, 1):
        assert logprobs[r].token == tokens[r]
        assert math.isclose(logprobs[r].logprob, float(exact[r, tokens[r]]), abs_tol=1e-4)
    values, ids = exact[0].topk(5)
    assert [t for t, _ in logprobs[0].top] == ids.tolist()
    assert all(math.isclose(a, float(b), abs_tol=1e-4) for (_, a), b in zip(logprobs[0].top, values))
    assert logprobs[1].top == [] and logprobs[2] is None


@pytest.mark.skipif(not HAS_C, reason="needs tp_llama's C kernels")
def test_top_logits_in_c_match_a_plain_sort():
    """The C pass for log-probabilities: each asked row's log-sum-exp (float64 reference) and its 20
    largest logits, best first, equal ones by lower id (ten tied maxima here), NaN never among them;
    a row's results do not depend on the others asked beside it."""
    logits = big_logits(4, seed=5)
    logits[1, 100:110] = logits[1].max() + 1
    logits[3, 7] = float("nan")
    lse, ids, values = _top_in_c(logits, [3, 1, 0], 20)
    for j, r in enumerate([3, 1, 0]):
        row = logits[r].tolist()
        order = sorted((i for i in range(VOCAB) if not math.isnan(row[i])), key=lambda i: (-row[i], i))[:20]
        assert ids[j].tolist() == order and values[j].tolist() == [row[i] for i in order]
        if r != 3:
            assert math.isclose(float(lse[j]), float(torch.logsumexp(logits[r].double(), 0)), abs_tol=1e-5)
    alone = _top_in_c(logits, [1], 20)
    assert torch.equal(alone[1][0], ids[1]) and float(alone[0][0]) == float(lse[1])


@pytest.mark.skipif(not HAS_C, reason="needs tp_llama's C kernels")
def test_top_logits_in_c_fill_a_row_short_of_numbers_with_its_nan_ids():
    """A row with fewer logits than asked that are not NaN (all NaN, here, or two of 20): the numbers
    first, then the NaN ones by id, with NaN values; those slots were left unwritten (ids past the vocabulary)."""
    nan = math.nan
    logits = torch.tensor([[nan] * 20, [nan, 1.0, nan, 2.0] + [nan] * 16, [float(i % 7) for i in range(20)]])
    for _ in range(3):  # unwritten memory differs from call to call
        _, ids, values = _top_in_c(logits, [0, 1, 2], 4)
        assert ids.tolist() == [[0, 1, 2, 3], [3, 1, 0, 2], [6, 13, 5, 12]]
        assert [[v if math.isfinite(v) else "nan" for v in row] for row in values.tolist()] == [
            ["nan"] * 4, [2.0, 1.0, "nan", "nan"], [6.0, 6.0, 5.0, 5.0]]


def test_a_seeded_row_draws_the_same_alone_and_beside_others():
    logits = big_logits(6, seed=7)
    params = SamplingParams(1, temperature=0.8, top_p=0.9, seed=3)
    alone = sample_rows(logits[2:3].clone(), [Row(params, torch.Generator().manual_seed(3))])[0]
    others = [Row(SamplingParams(1, temperature=1.0), torch.Generator().manual_seed(50 + r)) for r in range(6)]
    others[2] = Row(params, torch.Generator().manual_seed(3))
    assert sample_rows(logits, others)[0][2] == alone[0]


@pytest.mark.skipif(not HAS_C, reason="batch-invariant logits need tp_llama's C kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_seeded_request_generates_the_same_text_alone_and_batched(tmp_path, dtype: str):
    from tp_llama.config import EngineConfig
    from tp_llama.engine.core import Engine
    from tp_llama.engine.scheduler import Sequence
    from tp_llama.testing.synthetic import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt", family="llama3", mp=1, vocab_size=512)
    # On CPU, where the C kernels run; cuBLAS picks its kernels by batch size (a bfloat16 row drew
    # another token at the 20th step batched on an H100).
    engine = Engine.load(EngineConfig(str(ckpt), "tp", dtype, max_seq_len=64, max_batch_size=4, prefill_budget=64,
                                      device="cpu"))
    seeded = SamplingParams(24, temperature=0.9, top_p=0.95, top_k=200, seed=1234, ignore_eos=True)
    prompt = engine.tokenizer.encode("The keeper of the lamp", bos=True)
    alone = engine.generate([Sequence("a", prompt, seeded)])[0].output
    others = [Sequence(str(i), engine.tokenizer.encode(text, bos=True),
                       SamplingParams(24, temperature=1.0, ignore_eos=True)) for i, text in
              enumerate(["Once upon a time", "A ship", "Numbers: 1 2 3"])]
    batched = engine.generate([others[0], Sequence("b", prompt, seeded), *others[1:]])[1].output
    assert len(alone) == 24 and batched == alone


# Grammar masks (llguidance's layout: int32 [rows, words], bit j of word w allows token 32 w + j).
MASKED_SETTINGS = [SamplingParams(1), SamplingParams(1, temperature=1.0), SamplingParams(1, temperature=1.0, top_k=50),
                   SamplingParams(1, temperature=0.6, top_p=0.9), SamplingParams(1, temperature=0.8, min_p=0.05),
                   SamplingParams(1, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02),
                   SamplingParams(1, temperature=0.8, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.5,
                                  presence_penalty=0.3, logit_bias=((5, 4.0),)),
                   SamplingParams(1, repetition_penalty=1.5, logit_bias=((5, 30.0),))]
MASK_KINDS = ["free", "one", "all-but-best", "sparse", "half", "run", "tail"]


def mask_words(allowed: list[torch.Tensor], vocab: int, spare: int = 1) -> torch.Tensor:
    """Bool rows [V] as a bitmask, each row `spare` words wider than it needs and its bits past the
    vocabulary set: neither may be read as tokens."""
    words = (vocab + 31) // 32 + spare
    padded = torch.ones(len(allowed), words * 32, dtype=torch.bool)
    padded[:, :vocab] = torch.stack(allowed)
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    return (padded.view(len(allowed), words, 32).long() * weights).sum(-1).to(torch.int64).to(torch.int32)


def allowed_tokens(kind: str, logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    vocab = len(logits)
    if kind == "one":
        return torch.arange(vocab) == int(torch.randint(vocab, (), generator=gen))
    if kind == "all-but-best":
        return torch.arange(vocab) != int(logits.argmax())
    if kind in ("sparse", "half"):
        return torch.rand(vocab, generator=gen) < (0.005 if kind == "sparse" else 0.5)
    if kind == "run":  # as a grammar's digits: a run of ids on no boundary of 16 or 32
        return (torch.arange(vocab) >= 1003) & (torch.arange(vocab) < 1040)
    return torch.arange(vocab) >= vocab - 3  # "tail": only tokens of the last word, partly past the vocabulary


def seeded(params: list[SamplingParams], history: dict) -> list[Row]:
    return [Row(p, torch.Generator().manual_seed(1000 + r), **history) for r, p in enumerate(params)]


@pytest.mark.skipif(not HAS_C, reason="needs tp_llama's C kernels")
@pytest.mark.parametrize("vocab", [VOCAB, 4099])
def test_masked_rows_in_c_draw_what_their_masked_logits_draw(vocab: int):
    """Every setting (greedy, temperature, top_k, top_p, min_p, all of them, penalties) under every kind
    of mask (none, one token, all but the best, sparse, half, a run, only the last partial word), in
    one batch of free and constrained rows: the C kernels reading the masks pick exactly what
    apply_masks' -inf logits give the same kernels (the old way) and give PyTorch's argmax and bisection."""
    gen = torch.Generator().manual_seed(11)
    n = len(MASKED_SETTINGS) * len(MASK_KINDS)
    logits = torch.randn(n, vocab, generator=gen)
    logits[[r for r in range(n) if (r + r // len(MASKED_SETTINGS)) % 2]] *= 2.5  # each setting peaked and flat
    params = [MASKED_SETTINGS[r % len(MASKED_SETTINGS)] for r in range(n)]
    kinds = [MASK_KINDS[r // len(MASKED_SETTINGS)] for r in range(n)]
    history = {"prompt_ids": [5, 9, 9, 17, vocab - 1], "output": [5, 17, 17, 3]}
    bits = mask_words([allowed_tokens(kind, logits[r], gen) for r, kind in enumerate(kinds)], vocab)
    constrained = [r for r, kind in enumerate(kinds) if kind != "free"]

    got = sample_rows(logits, seeded(params, history), bits, constrained)[0]
    old = sample_rows(apply_masks(logits, bits, constrained), seeded(params, history))[0]
    masked = apply_masks(torch_penalize(logits, seeded(params, history)), bits, constrained)
    sampled = [r for r, p in enumerate(params) if p.temperature > 0]
    uniforms = [float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(1000 + r)))
                for r in sampled]
    want = masked.argmax(-1)
    want[sampled] = draw_by_bisection(masked, sampled, [params[r] for r in sampled], uniforms)
    assert got == old == want.tolist()
    assert all(bool(masked[r, got[r]] > float("-inf")) for r in constrained)  # only allowed tokens
    best_refused = MASK_KINDS.index("all-but-best") * len(MASKED_SETTINGS)  # a greedy row
    assert got[best_refused] != int(logits[best_refused].argmax())


@pytest.mark.skipif(not HAS_C, reason="needs tp_llama's C kernels")
def test_masked_rows_in_c_treat_refused_tokens_as_minus_infinity():
    """The edges, against the old way (apply_masks, then the same kernels) and torch.argmax: a NaN the
    mask refuses is passed over and one it allows is taken, a row whose allowed logits are all -inf or
    that allows nothing takes 0 as a row of -inf does, an allowed +inf wins."""
    inf, nan, vocab = math.inf, math.nan, 37
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, vocab, generator=gen)
    allowed = [torch.rand(vocab, generator=gen) < 0.4 for _ in range(8)]
    allowed[3][:] = False
    for r in (0, 5):  # a NaN and the row's largest logit refused
        logits[r, 4], logits[r, 30], allowed[r][4], allowed[r][30] = nan, 9.0, False, False
    logits[1, 20], allowed[1][20] = nan, True  # an allowed NaN
    logits[2, allowed[2]] = -inf
    logits[6, 33], allowed[6][33] = inf, True
    logits[7, allowed[7]], allowed[7][0] = -inf, False
    bits, constrained = mask_words(allowed, vocab), list(range(8))
    for temperature in (0.0, 0.7):
        params = [SamplingParams(1, temperature=temperature, top_k=5 if r % 2 else 0) for r in range(8)]
        got = sample_rows(logits, seeded(params, {}), bits, constrained)[0]
        old = sample_rows(apply_masks(logits, bits, constrained), seeded(params, {}))[0]
        assert got == old, temperature
        if temperature == 0:
            assert got == apply_masks(logits, bits, constrained).argmax(-1).tolist()
            assert got[1] == 20 and got[2] == got[3] == got[7] == 0 and got[6] == 33


def test_constrained_rows_keep_raw_logprobs_and_mask_without_a_copy_in_c(monkeypatch):
    """Where the C kernels run, no row is masked by apply_masks (the kernels read the bitmask); elsewhere
    it is. Either way the log-probabilities are those of the raw logits."""
    logits = big_logits(2, seed=9)
    allowed = [torch.arange(VOCAB) % 7 == 3, torch.ones(VOCAB, dtype=torch.bool)]
    bits = mask_words(allowed, VOCAB, spare=0)
    params = [SamplingParams(1, temperature=0.7, logprobs=2), SamplingParams(1, logprobs=2)]
    calls = []
    real = sampling.apply_masks
    monkeypatch.setattr(sampling, "apply_masks", lambda *a: calls.append(1) or real(*a))
    tokens, logprobs = sample_rows(logits, seeded(params, {}), bits, [0, 1])
    assert len(calls) == (0 if HAS_C else 1) and tokens[0] % 7 == 3
    exact = torch.log_softmax(logits.double(), dim=-1)
    for r in (0, 1):
        assert math.isclose(logprobs[r].logprob, float(exact[r, tokens[r]]), abs_tol=1e-4)
    monkeypatch.setattr(sampling, "in_c", lambda _: False)
    assert sample_rows(logits, seeded(params, {}), bits, [0, 1])[0] == tokens and len(calls) == (1 if HAS_C else 2)


@pytest.mark.parametrize("name, value", [("temperature", math.nan), ("repetition_penalty", math.nan),
                                         ("top_p", math.nan), ("seed", -1), ("seed", 2**64)])
def test_nan_and_seeds_out_of_range_are_refused(name: str, value: float, capsys) -> None:
    """The offline CLI's float flags read "nan" (--temperature nan drew token 0 every step); --seed any int."""
    with pytest.raises(ValueError, match=name):
        check_params(SamplingParams(4, **{name: value}))
    flag = "--" + name.replace("_", "-")  # and the CLI names it before it loads anything
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--ckpt-dir", "nowhere", "--prompt", "hi", flag, str(value)])
    assert stopped.value.code == 2 and name in capsys.readouterr().err


def test_a_prompt_too_long_for_max_seq_len_is_refused_before_the_checkpoint_loads(synthetic_checkpoint, monkeypatch,
                                                                                    capfd) -> None:
    """The offline CLI reads only the tokenizer to refuse it (it failed after every rank had loaded the model)."""
    ckpt = synthetic_checkpoint("llama3", mp=1)
    monkeypatch.setattr(generate.Engine, "load", lambda config: pytest.fail("the checkpoint was loaded"))
    prompt = "the lighthouse keeper " * 10  # 30 words: more than 8 tokens, whatever the merges
    assert generate.main(["--ckpt-dir", str(ckpt), "--prompt", "hi", "--prompt", prompt, "--max-new-tokens", "8",
                          "--max-seq-len", "16"]) == 2
    assert re.search(r"error: prompt 2 \(\d+ tokens\) plus --max-new-tokens \(8\) exceeds --max-seq-len 16",
                     capfd.readouterr().err)
