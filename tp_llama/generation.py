"""Batched generation: per-row prefill into the KV cache, then one decode step for all rows.

Rank 0 picks every token and broadcasts it, so sampling can never send ranks different ways.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tp_llama.distributed import broadcast_from_rank0
from tp_llama.faults import inject_fault


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"


@dataclass
class GenerationStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0


def check_request(request: GenerationRequest, max_seq_len: int) -> None:
    if not request.prompt_ids:
        raise ValueError("the prompt is empty")
    if request.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
    total = len(request.prompt_ids) + request.max_new_tokens
    if total > max_seq_len:
        raise ValueError(
            f"prompt ({len(request.prompt_ids)} tokens) plus max_new_tokens ({request.max_new_tokens}) "
            f"exceeds max_seq_len {max_seq_len}"
        )
    if request.temperature < 0 or not 0 < request.top_p <= 1:
        raise ValueError("temperature must be >= 0 and top_p in (0, 1]")


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise nucleus sampling over the smallest set with mass >= top_p."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(order[choice])


def _generators(requests: list[GenerationRequest]) -> list[torch.Generator]:
    gens = []
    for request in requests:
        gen = torch.Generator()
        gen.manual_seed(request.seed if request.seed is not None else secrets.randbits(63))
        gens.append(gen)
    return gens


@torch.inference_mode()
def generate(
    model: nn.Module,
    requests: list[GenerationRequest],
    stop_ids: frozenset[int],
    device: torch.device,
    rank: int,
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    stats: GenerationStats | None = None,
) -> list[GenerationResult]:
    """Generate for up to model.max_batch_size requests; every rank calls it with the same requests."""
    batch = len(requests)
    if batch > model.max_batch_size:
        raise ValueError(f"{batch} requests exceed max_batch_size {model.max_batch_size}")
    for request in requests:
        check_request(request, model.max_seq_len)
    stats = stats if stats is not None else GenerationStats()
    generators = _generators(requests) if rank == 0 else []

    started = time.perf_counter()
    last_logits = []
    for row, request in enumerate(requests):
        tokens = torch.tensor([request.prompt_ids], device=device)
        start = torch.zeros(1, dtype=torch.long, device=device)
        last_logits.append(model(tokens, start, slice(row, row + 1)))
    logits = torch.cat(last_logits)
    stats.prefill_tokens += sum(len(r.prompt_ids) for r in requests)
    stats.prefill_s += time.perf_counter() - started

    started = time.perf_counter()
    outputs: list[list[int]] = [[] for _ in requests]
    finish: list[str | None] = [None] * batch
    positions = torch.tensor([len(r.prompt_ids) for r in requests], device=device)
    while True:
        inject_fault("decode", rank, device)
        picked = torch.zeros(batch, dtype=torch.long)
        if rank == 0:
            host_logits = logits.float().cpu()
            for row, request in enumerate(requests):
                if finish[row] is None:
                    picked[row] = sample(host_logits[row], request.temperature, request.top_p, generators[row])
        picked = broadcast_from_rank0(picked, device)
        new_tokens: list[list[int]] = [[] for _ in requests]
        for row, request in enumerate(requests):
            if finish[row] is not None:
                continue
            token = int(picked[row])
            if token in stop_ids and not request.ignore_eos:
                finish[row] = "stop"
                continue
            outputs[row].append(token)
            new_tokens[row].append(token)
            if len(outputs[row]) >= request.max_new_tokens:
                finish[row] = "length"
        stats.decode_tokens += sum(len(t) for t in new_tokens)
        if on_tokens is not None:
            on_tokens(new_tokens)
        if all(reason is not None for reason in finish):
            break
        active = torch.tensor([reason is None for reason in finish], device=device)
        logits = model(picked.to(device).unsqueeze(1), positions, slice(0, batch))
        # Finished rows keep re-writing their last slot so they never run past max_seq_len.
        positions = positions + active.long()
    stats.decode_s += time.perf_counter() - started
    return [GenerationResult(out, reason) for out, reason in zip(outputs, finish)]
