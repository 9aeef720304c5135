"""Picking the next token of every sampling row at once, on rank 0."""

from __future__ import annotations

import torch


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


def sample_rows(
    logits: torch.Tensor, settings: list[tuple[float, float, torch.Generator | None]]
) -> list[int]:
    """One token per row of logits [R, V]; settings[r] = (temperature, top_p, generator).

    Greedy rows take one argmax over the batch (one host copy); the others sample row by row with
    their own generator, so a seeded request draws the same tokens whatever runs beside it.
    """
    if not settings:
        return []
    picked = logits.argmax(dim=-1).tolist()
    for row, (temperature, top_p, generator) in enumerate(settings):
        if temperature > 0:
            picked[row] = sample(logits[row].cpu(), temperature, top_p, generator)
    return picked
