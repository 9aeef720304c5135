"""Picking a step's tokens where rows carry proposals: each proposal is accepted while the token drawn
at its position equals it, so every position's token comes from the model exactly as without
speculation.

A row with k proposals returns logits at k + 1 positions. Position 0 is sampled for every row as in
any step (grammar masks included; rows under a grammar carry no proposals). Then, position by
position, the rows whose draw equalled their proposal draw again at the next position, each with the
accepted proposals in its history (penalties count them) and its own generator, which so consumes one
number per emitted token, as without speculation: seeded and greedy replies do not change. A row's
first draw that differs from its proposal (or its draw after the last proposal) is its picked token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tp_llama.engine.plan import Row
from tp_llama.engine.sampling import History, SamplingParams, TokenLogprobs, sample_rows


@dataclass
class Accepted:
    """A sequence's history with the proposals accepted so far after its output (sampling's History)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output: list[int]


def verify_rows(logits: torch.Tensor, rows: list[Row], groups: list[list[History]], allowed: torch.Tensor | None,
                constrained: list[int]) -> tuple[list[int], list[TokenLogprobs | None], dict[int, list]]:
    """rows: the step's rows; groups: per sampling row, the sequences that pick from it; logits: each
    sampling row's logits_wanted positions, in row order. Returns one picked token per sampler (the
    groups flattened) with its log-probabilities, and per row with proposals (by index in `rows`) the
    log-probabilities of the proposals it accepted (their count is how many it accepted)."""
    at = [i for i, row in enumerate(rows) if row.sample]  # each sampling row's index in `rows`
    starts = [0]  # each sampling row's first logits
    for i in at:
        starts.append(starts[-1] + rows[i].logits_wanted)
    flat = [seq for group in groups for seq in group]
    plain = len(flat) == len(at) == len(logits)  # one sampler and one position a row: the logits as they are
    head = logits if plain else logits[[starts[r] for r, group in enumerate(groups) for _ in group]]
    picked, logprobs = sample_rows(head, flat, allowed, constrained)
    place = [0]  # each sampling row's first sampler in `flat`
    for group in groups:
        place.append(place[-1] + len(group))
    speculating = [r for r, i in enumerate(at) if rows[i].proposed]  # one sampler each
    verified: dict[int, list] = {at[r]: [] for r in speculating}
    alive = {r: Accepted(flat[place[r]].params, flat[place[r]].generator, flat[place[r]].prompt_ids,
                         list(flat[place[r]].output)) for r in speculating}
    position = 1
    while True:
        alive = {r: history for r, history in alive.items()
                 if position <= rows[at[r]].proposed and picked[place[r]] == rows[at[r]].tokens[position]}
        if not alive:
            return picked, logprobs, verified
        for r, history in alive.items():  # its draw equalled its proposal: accepted
            verified[at[r]].append(logprobs[place[r]])
            history.output.append(rows[at[r]].tokens[position])
        order = list(alive)
        tokens, token_logprobs = sample_rows(logits[[starts[r] + position for r in order]], [alive[r] for r in order])
        for r, token, token_lp in zip(order, tokens, token_logprobs):
            picked[place[r]], logprobs[place[r]] = token, token_lp
        position += 1
