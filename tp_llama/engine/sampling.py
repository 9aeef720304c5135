"""Picking the next token of every sampling row of a step at once, on rank 0, on the logits' device.

The order is vLLM's. Penalties and logit_bias change the logits (greedy rows too): the bias (a logits
processor in vLLM, run before its penalties), then repetition (vLLM's meaning, over prompt and generated
tokens: positive logits divided by it, negative ones multiplied), then frequency and presence (OpenAI's,
over the generated tokens).
Greedy rows take the argmax. Sampled rows divide by their temperature, keep the tokens at or
above min_p of the best one, then their top_k, then the smallest set of the highest whose
probability reaches top_p of what is left (ties at each boundary kept together), and draw by the
inverse CDF in token order with one uniform from the row's own generator: a seeded request
consumes one number of its stream per step, whatever runs beside it. Every filter is a threshold
on the logit, found without sorting the vocabulary: by tp_llama's C kernel on CPUs that have it
(kernels/cpu/sample.c), elsewhere by bisection over the logits' sortable bits, which needs no
host sync. A row under a structured output's grammar (engine/constraint.py) takes only the tokens
its bitmask allows, as if every other were -inf: the C kernels read the bitmask and skip what it
refuses; elsewhere the refused logits are set to -inf first (apply_masks). Log-probabilities are
those of the model's own distribution (log_softmax of the raw logits, before penalties, grammar
masks and temperature), as vLLM returns by default.
"""

from __future__ import annotations

import ctypes
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch

from tp_llama.kernels.cpu import ffi

MAX_LOGPROBS = 20  # the most alternatives a token's log-probabilities list (OpenAI's top_logprobs limit)
SEED_LIMIT = 2**63  # seeds are in [0, 2**63): what an int64 holds (a larger one failed in the step)
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: smaller temperatures are greedy, as dividing float32 logits overflows


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; N: the token's log-probability and the N most likely
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's log-probability and the N most likely
    seed: int | None = None
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """Below GREEDY_BELOW, as vLLM's engine does, for every caller (the CLI, the engine), not only the API's:
        1 / T past float32's range (T < 3e-39) made sample.c's weights NaN and drew token 0."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return bool(self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty
                    or self.logit_bias)


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens and their log-probabilities, best first


class History(Protocol):
    """What sampling reads of a sequence."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output: list[int]


def check_params(params: SamplingParams, vocab_size: int | None = None) -> None:
    """The sampler's own limits (the front doors check their fields first, naming them)."""
    # Written so that NaN fails too (the CLI's float flags read "nan"): a NaN temperature drew token 0.
    if not params.temperature >= 0 or not 0 < params.top_p <= 1 or not 0 <= params.min_p <= 1:
        raise ValueError("temperature must be >= 0, top_p in (0, 1] and min_p in [0, 1]")
    if params.top_k < 0 or not params.repetition_penalty > 0:
        raise ValueError("top_k must be >= 0 and repetition_penalty > 0")
    if params.seed is not None and not 0 <= params.seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**63), got {params.seed}")
    for name, value in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}]")
    if vocab_size is not None and any(not 0 <= token < vocab_size for token, _ in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")


def sample_rows(logits: torch.Tensor, rows: list[History], allowed: torch.Tensor | None = None,
                constrained: list[int] = ()) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of logits [R, V] (float32), and its log-probabilities where the row asks;
    the rows listed in `constrained` take only the tokens their bits in `allowed` (a bitmask
    [R, ceil(V / 32)] int32) permit."""
    if not rows:
        return [], []
    raw, c = logits, in_c(logits)
    if any(row.params.penalized for row in rows):
        logits = (_penalize_in_c if c else penalize)(logits, rows)
    words, masks = None, [None] * len(rows)  # words: what `masks` point into, held until the kernels return
    if constrained and c:
        words, masks = mask_addresses(allowed, list(constrained), len(rows), logits.shape[1])
    elif constrained:
        logits = apply_masks(logits, allowed, list(constrained))
    picked = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
    greedy = [r for r, row in enumerate(rows) if row.params.greedy]
    sampled = [r for r, row in enumerate(rows) if not row.params.greedy]
    if greedy:
        chosen = logits[greedy] if sampled else logits
        picked[greedy] = _argmax_in_c(chosen, [masks[r] for r in greedy]) if c else chosen.argmax(dim=-1)
    if sampled:
        uniforms = [_uniform(rows[r]) for r in sampled]
        params = [rows[r].params for r in sampled]
        if c:
            picked[sampled] = _draw_in_c(logits, sampled, params, uniforms, [masks[r] for r in sampled])
        else:
            picked[sampled] = draw_by_bisection(logits, sampled, params, uniforms)
    tokens = picked.tolist()
    del words
    return tokens, _logprobs(raw, rows, tokens)


def apply_masks(logits: torch.Tensor, bits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of logits [R, V] whose listed rows hold -inf wherever their bitmask's bit is clear."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bits[rows].unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[1]].bool()
    masked = logits.clone()
    at = torch.tensor(rows, device=logits.device)
    masked[at] = torch.where(allowed.to(logits.device), logits[at], float("-inf"))
    return masked


def mask_addresses(bits: torch.Tensor, rows: list[int], n_rows: int,
                   vocab: int) -> tuple[torch.Tensor, list[int | None]]:
    """The bitmask [R, ceil(V / 32)] as the C kernels read it (int32 on the CPU, each row's words in
    a run), and each of the n_rows logits rows' mask address in it: its row of it where listed in
    `rows`, else None. The kernels read those addresses while the returned words are alive."""
    if bits.dim() != 2 or bits.shape[1] * 32 < vocab or not all(0 <= r < bits.shape[0] for r in rows):
        raise ValueError(f"a token bitmask [{list(bits.shape)}] for rows {rows} of a vocabulary of {vocab}")
    bits = bits.to("cpu", torch.int32).contiguous()
    stride = bits.stride(0) * bits.element_size()
    masks: list[int | None] = [None] * n_rows
    for r in rows:
        masks[r] = bits.data_ptr() + r * stride
    return bits, masks


def penalize(logits: torch.Tensor, rows: list[History]) -> torch.Tensor:
    """The rows' logit_bias, then their penalties (vLLM's order), on a copy of logits [R, V]: each kind one indexed
    op over every (row, token) it touches, whatever the number of rows."""
    logits = logits.clone()
    repeat, shift, bias = ([], [], []), ([], [], []), ([], [], [])  # (rows, tokens, values) of each kind
    for r, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = set(row.prompt_ids) | set(row.output)
            repeat[0].extend([r] * len(seen))
            repeat[1].extend(seen)
            repeat[2].extend([p.repetition_penalty] * len(seen))
        if p.frequency_penalty or p.presence_penalty:
            for token, count in Counter(row.output).items():
                shift[0].append(r)
                shift[1].append(token)
                shift[2].append(p.frequency_penalty * count + p.presence_penalty)
        for token, value in p.logit_bias:
            bias[0].append(r)
            bias[1].append(token)
            bias[2].append(value)
    def indexed(kind: tuple[list, list, list]) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        rows_at, tokens, values = (torch.tensor(part, device=logits.device) for part in kind)
        return (rows_at, tokens), values

    if bias[0]:
        logits.index_put_(*indexed(bias), accumulate=True)
    if repeat[0]:
        at, factor = indexed(repeat)
        values = logits[at]
        # A tiny penalty divides past float32's range: the largest float keeps the token certain without an inf,
        # which no draw or log-probability takes (sample.c stops there too)
        divided = (values / factor).clamp(max=torch.finfo(values.dtype).max)
        logits[at] = torch.where(values > 0, divided, values * factor)
    if shift[0]:
        at, amounts = indexed(shift)
        logits.index_put_(at, -amounts, accumulate=True)
    return logits


def _penalize_in_c(logits: torch.Tensor, rows: list[History]) -> torch.Tensor:
    """penalize by the C kernel, a pass over each row's history: PyTorch's indexed ops spend most of their
    time building index tensors from lists (bench/kernels/sampling.py's penalties)."""
    lib = ffi.library()
    logits = logits.contiguous().clone()
    held, specs = [], []  # the arrays the call reads, kept alive until it returns
    for r, row in enumerate(rows):
        p = row.params
        if not p.penalized:
            continue
        reads_output = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        prompt = row.prompt_ids if p.repetition_penalty != 1.0 else []
        tokens = array("q", prompt)
        tokens.extend(row.output if reads_output else [])
        ids, values = array("q", [t for t, _ in p.logit_bias]), array("f", [v for _, v in p.logit_bias])
        held += [tokens, ids, values]
        specs.append((r, tokens.buffer_info()[0], len(prompt), len(tokens) - len(prompt), ids.buffer_info()[0],
                      values.buffer_info()[0], len(ids), p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
    status = lib.penalize_rows(logits.data_ptr(), logits.shape[1], (lib.structs["PenaltyRow"] * len(specs))(*specs),
                               len(specs))
    if status == lib.constants["TPL_BAD_TOKEN"]:
        raise ValueError(f"a prompt, output or logit_bias token id lies outside the vocabulary of {logits.shape[1]}")
    if status:
        raise MemoryError("no memory to penalize")
    return logits


def in_c(logits: torch.Tensor) -> bool:
    """Whether the C kernels sample these logits: on CPU, where they built."""
    return logits.device.type == "cpu" and ffi.load()[0] is not None


def _argmax_in_c(logits: torch.Tensor, masks: list[int | None] | None = None) -> torch.Tensor:
    """torch.argmax of each row, in one pass over the logits and a second over L2, where PyTorch's is slow
    at Llama 3's vocabulary (bench/kernels/sampling.py's greedy); a row with a mask address (mask_addresses)
    as if the tokens it refuses were -inf, its refused chunks skipped."""
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.long)
    pointers = (ctypes.c_void_p * len(masks))(*masks) if masks and any(masks) else None
    ffi.library().argmax_rows(logits.data_ptr(), logits.shape[1], logits.shape[0], pointers, out.data_ptr())
    return out


def _draw_in_c(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], uniforms: list[float],
               masks: list[int | None] | None = None) -> torch.Tensor:
    lib = ffi.library()
    logits = logits.contiguous()
    masks = masks or [None] * len(rows)
    # A top_k of the vocabulary or more is no limit: kept as it is, one past int64 wrapped to a small k (the CLI's)
    specs = (lib.structs["SampleRow"] * len(rows))(*(
        (r, min(p.top_k, logits.shape[1]), p.temperature, p.top_p, p.min_p, u, mask, 0)
        for r, p, u, mask in zip(rows, params, uniforms, masks)))
    if lib.sample_rows(logits.data_ptr(), logits.shape[1], specs, len(rows)):
        raise MemoryError("no memory to sample")
    return torch.tensor([spec.token for spec in specs], device=logits.device)


def sortable(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 keys in the same order (NaN aside)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _highest_key(keys: torch.Tensor, weights: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """Per row, the largest key t whose tokens at or above it weigh at least `need` (33 bisection
    steps over the int32 range: exact, and no host sync)."""
    lo = torch.full_like(need, -(2**31), dtype=torch.int64)
    hi = torch.full_like(need, 2**31, dtype=torch.int64)
    for _ in range(33):
        mid = (lo + hi) // 2
        enough = torch.where(keys >= mid.unsqueeze(1), weights, 0).sum(-1) >= need
        lo, hi = torch.where(enough, mid, lo), torch.where(enough, hi, mid)
    return lo


def draw_by_bisection(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                      uniforms: list[float]) -> torch.Tensor:
    """The sample.c draw in PyTorch, for devices without it: the same filters and the same inverse CDF."""
    device = logits.device
    as_column = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)  # noqa: E731
    x = logits[rows].float()
    # -0.0 + 0.0 is +0.0: equal logits get equal keys (tied, as sample.c's compares tie them); a NaN is
    # a -inf, never the best nor drawn, as its weight is 0 in sample.c.
    x = torch.where(x.isnan(), float("-inf"), x + 0.0)
    z = (x - x.max(dim=-1, keepdim=True).values) / as_column([p.temperature for p in params])
    w = torch.exp(z).nan_to_num(0.0)
    w = torch.where(w >= as_column([p.min_p for p in params]), w, 0).double()
    keys = sortable(x)
    top_k = as_column([min(p.top_k, x.shape[1]) for p in params], torch.int64).squeeze(1)  # past int64: no limit
    limited = (top_k > 0) & (top_k < x.shape[1])
    floor_k = _highest_key(keys, (w > 0).double(), top_k.double())
    w = torch.where(limited.unsqueeze(1) & (keys < floor_k.unsqueeze(1)), 0, w)
    top_p = as_column([p.top_p for p in params], torch.float64).squeeze(1)
    floor_p = _highest_key(keys, w, top_p * w.sum(-1))
    w = torch.where((top_p < 1).unsqueeze(1) & (keys < floor_p.unsqueeze(1)), 0, w)
    cumulative = w.cumsum(-1)
    target = as_column(uniforms, torch.float64) * cumulative[:, -1:]
    picked = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    return torch.minimum(picked, (w > 0).cumsum(-1).argmax(-1))  # rounding past the end: the last kept


def take_forced(raw: torch.Tensor, rows: list[History], tokens: list[int]) -> list[TokenLogprobs | None]:
    """Rows of raw [R, V] whose grammar allows one token, `tokens`: each is its row's without a draw, but a
    sampled row still spends its uniform, so its later draws are those of a reply picked a token a step."""
    for row in rows:
        if not row.params.greedy:
            _uniform(row)
    return _logprobs(raw, rows, tokens)


def _uniform(row: History) -> float:
    """The next number of a sampled row's own stream: one per token it emits, drawn or forced."""
    return float(torch.rand((), dtype=torch.float64, generator=row.generator))


def _logprobs(raw: torch.Tensor, rows: list[History], tokens: list[int]) -> list[TokenLogprobs | None]:
    wanted = [r for r, row in enumerate(rows) if row.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return out
    most = min(max(rows[r].params.logprobs for r in wanted), raw.shape[1])
    lse, ids, values = top_logits(raw, wanted, most)
    chosen = (raw[wanted, [tokens[r] for r in wanted]].double() - lse).tolist()
    values, ids = (values.double() - lse.unsqueeze(1)).tolist(), ids.tolist()
    for i, r in enumerate(wanted):
        n = rows[r].params.logprobs
        out[r] = TokenLogprobs(tokens[r], chosen[i], list(zip(ids[i][:n], values[i][:n])))
    return out


def top_logits(raw: torch.Tensor, rows: list[int], top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp [R] float64, ids [R, top], logits [R, top]) of these rows of raw [., V] float32,
    best first; top <= V."""
    return (_top_in_c if in_c(raw) else _top_in_torch)(raw, rows, top)


def _top_in_c(raw: torch.Tensor, rows: list[int], top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp [R] float64, ids [R, top], logits [R, top]) of the rows, best first."""
    raw, at = raw.contiguous(), torch.tensor(rows)
    lse = torch.empty(len(rows), dtype=torch.float64)
    ids = torch.empty(len(rows), top, dtype=torch.long)
    values = torch.empty(len(rows), top, dtype=torch.float32)
    ffi.library().top_logits(raw.data_ptr(), raw.shape[1], at.data_ptr(), len(rows), top,
                             lse.data_ptr(), ids.data_ptr(), values.data_ptr())
    return lse, ids, values


def _top_in_torch(raw: torch.Tensor, rows: list[int], top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = raw[rows]
    values, ids = x.topk(top, dim=-1)
    return torch.logsumexp(x.double(), dim=-1), ids, values
