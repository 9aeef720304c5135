"""Prompt log-probabilities: every scored position's next-token log-probability and its most likely tokens.

An echo request (OpenAI's `echo` with `logprobs`) and the perplexity CLI both come here, through
the step's rows (`Row.score`). Under tensor parallelism the output layer is split on the
vocabulary, so each rank reduces its own slice of the logits: per position its log-sum-exp, the
logit of the target token when the slice holds it, and its top N logits with their ids. Only those
2 + 2N numbers per position cross ranks (one gather to rank 0), never a row of logits; rank 0
merges them: the log-sum-exp of the slices' log-sum-exps, the one finite target logit, and the best
N of the slices' tops. The reductions are the sampler's (`top_logits`: the C kernel on CPU).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from tp_llama.engine.plan import Row
from tp_llama.engine.sampling import TokenLogprobs, top_logits
from tp_llama.engine.sequence import Sequence
from tp_llama.kernels import linear
from tp_llama.parallel.layout import GATHER
from tp_llama.parallel.modules import LocalLinear, gather_last_dim_to_rank0

# Positions reduced at once: bounds the slice of logits a step holds (positions x local vocabulary).
SLICE_ELEMENTS = 1 << 24


def slice_stats(logits: torch.Tensor, start: int, n_words: int, targets: torch.Tensor, top: int) -> torch.Tensor:
    """Per position of logits [n, v] (vocabulary ids start .. start + v - 1, those from n_words on left
    out: the engine never picks them): [log-sum-exp, target logit, top logits..., their ids...] in
    float64, -inf (and id 0) where the slice has none."""
    n, device = logits.shape[0], logits.device
    out = torch.full((n, 2 + 2 * top), -math.inf, dtype=torch.float64, device=device)
    out[:, 2 + top :] = 0
    width = max(0, min(logits.shape[1], n_words - start))
    if n == 0 or width == 0:
        return out
    logits = logits[:, :width].float().contiguous()
    k = min(top, width)
    lse, ids, values = top_logits(logits, list(range(n)), k)
    out[:, 0] = lse.to(device)
    local = targets - start
    inside = (local >= 0) & (local < width)
    chosen = logits.gather(1, local.clamp(0, width - 1).unsqueeze(1)).squeeze(1).double()
    out[:, 1] = torch.where(inside, chosen, -math.inf)
    out[:, 2 : 2 + k] = values.to(device).double()
    out[:, 2 + top : 2 + top + k] = (ids.to(device) + start).double()
    return out


def merge_stats(stats: torch.Tensor, slices: int, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slices' stats side by side [n, slices * (2 + 2 top)] -> (target log-probability [n],
    top ids [n, top], top log-probabilities [n, top]) over the whole vocabulary.

    The slices come in vocabulary order and each lists equal logits lower id first, so a stable sort
    keeps that order across slices too.
    """
    parts = stats.view(stats.shape[0], slices, 2 + 2 * top)
    lse = torch.logsumexp(parts[:, :, 0], dim=1)
    target = parts[:, :, 1].amax(dim=1)
    values = parts[:, :, 2 : 2 + top].reshape(stats.shape[0], slices * top)
    ids = parts[:, :, 2 + top :].reshape(stats.shape[0], slices * top)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :top]
    return target - lse, ids.gather(1, order).long(), values.gather(1, order) - lse.unsqueeze(1)


def score_hidden(head: nn.Module, hidden: torch.Tensor, targets: list[int], top: int, n_words: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """hidden [n, dim]: the final norm's output at the scored positions, on every rank; targets: the
    token each predicts. Rank 0 of the head's group gets (log-probability [n], top ids [n, top], top
    log-probabilities [n, top]) on the host; the other ranks None.

    head: the model's output layer (a LocalLinear, split on the vocabulary under TP, or a Linear).
    """
    split = isinstance(head, LocalLinear) and head.comm == GATHER
    slices = dist.get_world_size(head.group) if split else 1
    rank = dist.get_rank(head.group) if split else 0
    step = max(1, SLICE_ELEMENTS // n_words)  # the same on every rank: they gather in step
    results = []
    for at in range(0, hidden.shape[0], step):
        x = hidden[at : at + step]
        logits = (linear(x, head.weight) if isinstance(head, LocalLinear) else head(x)).float()
        wanted = torch.tensor(targets[at : at + x.shape[0]], dtype=torch.long, device=logits.device)
        stats = slice_stats(logits, rank * logits.shape[1], n_words, wanted, top)
        if split:
            stats = gather_last_dim_to_rank0(stats, head.group)
        if rank == 0:
            results.append(merge_stats(stats.cpu(), slices, top))
    if rank != 0:
        return None
    if not results:
        return torch.empty(0, dtype=torch.float64), torch.empty(0, top, dtype=torch.long), torch.empty(0, top)
    return tuple(torch.cat(part) for part in zip(*results))


def score_logits(logits: torch.Tensor, targets: list[int], top: int, n_words: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same from whole logits [n, V] held by this rank (the fsdp mode's output layer is not split)."""
    wanted = torch.tensor(targets, dtype=torch.long, device=logits.device)
    return merge_stats(slice_stats(logits, 0, n_words, wanted, top).cpu(), 1, top)


def row_entries(rows: list[Row], scores: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                ) -> list[list[TokenLogprobs] | None]:
    """Per row of the step, its scored positions' entries (None for a row that scores nothing), from
    the step's scores in row order."""
    out: list[list[TokenLogprobs] | None] = [None] * len(rows)
    if scores is None:
        return out
    logprobs, ids, values = (part.tolist() for part in scores)
    at = 0
    for i, row in enumerate(rows):
        if row.score < 0:
            continue
        out[i] = [TokenLogprobs(target, logprobs[at + j], list(zip(ids[at + j][: row.score], values[at + j][: row.score])))
                  for j, target in enumerate(row.targets())]
        at += row.scored
    return out


def prompt_scores(seq: Sequence, start: int, end: int) -> tuple[int, int, int]:
    """Row.score, scored and next_token for positions start .. end - 1 of a sequence: the positions whose
    next token is a prompt token not scored yet (all of them again after a preemption that lost some)."""
    top, last = seq.params.prompt_logprobs, len(seq.prompt_ids) - 1
    stop = min(end, last)
    if top is None or stop <= start or stop <= len(seq.prompt_logprobs):
        return -1, 0, -1
    return top, stop - start, seq.prompt_ids[end] if end <= last else -1
