"""Picking a step's tokens where rows carry proposals: each proposal is accepted while the token drawn
at its position equals it, so every position's token comes from the model exactly as without
speculation.

A row with k proposals returns logits at k + 1 positions. Position 0 is sampled for every row as in
any step. Then, position by position, the rows whose draw equalled their proposal draw again at the
next position, each with the accepted proposals in its history (penalties count them) and its own
generator, which so consumes one number per emitted token, as without speculation: seeded and greedy
replies do not change. A row's first draw that differs from its proposal (or its draw after the last
proposal) is its picked token.

Rows under a grammar draw under its mask at each position (engine/constraint.py computes one per
position from the proposals). Their first proposals may be forced tokens, the only token the grammar
allows there: those are taken without a draw (`take_forced`: the uniform is still spent), so they are
always accepted and no mask is computed for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tp_llama.engine.plan import Row
from tp_llama.engine.sampling import History, SamplingParams, TokenLogprobs, sample_rows, take_forced

if TYPE_CHECKING:  # llguidance (and the torch.compile its torch helpers bring) only where a grammar is used
    from tp_llama.engine.constraint import StepMasks


@dataclass
class Accepted:
    """A sequence's history with the proposals accepted so far after its output (sampling's History)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output: list[int]


def verify_rows(logits: torch.Tensor, rows: list[Row], groups: list[list[History]], masks: StepMasks | None,
                forced: list[int]) -> tuple[list[int], list[TokenLogprobs | None], dict[int, list]]:
    """rows: the step's rows; groups: per sampling row, the sequences that pick from it; logits: each
    sampling row's logits_wanted positions, in row order; masks: the constrained samplers' (by index in
    the groups flattened); forced: per row, how many of its proposals are forced. Returns one picked
    token per sampler with its log-probabilities, and per row with proposals (by index in `rows`) the
    log-probabilities of the proposals it accepted (their count is how many it accepted)."""
    at = [i for i, row in enumerate(rows) if row.sample]  # each sampling row's index in `rows`
    starts = [0]  # each sampling row's first logits
    for i in at:
        starts.append(starts[-1] + rows[i].logits_wanted)
    flat = [seq for group in groups for seq in group]
    place = [0]  # each sampling row's first sampler in `flat`
    for group in groups:
        place.append(place[-1] + len(group))
    speculating = {place[g]: g for g, i in enumerate(at) if rows[i].proposed}  # sampler: its sampling row
    row_of = {s: rows[at[g]] for s, g in speculating.items()}
    taken = {s: row_of[s].tokens[1 : 1 + forced[at[g]]] for s, g in speculating.items() if forced[at[g]]}
    plain = len(flat) == len(at) == len(logits)  # one sampler and one position a row: the logits as they are
    head = logits if plain else logits[[starts[g] for g, group in enumerate(groups) for _ in group]]
    picked, logprobs = _pick(head, flat, list(range(len(flat))), 0, taken, masks)
    verified: dict[int, list] = {at[g]: [] for g in speculating.values()}
    alive = {s: Accepted(flat[s].params, flat[s].generator, flat[s].prompt_ids, list(flat[s].output))
             for s in speculating}
    position = 1
    while True:
        alive = {s: history for s, history in alive.items()
                 if position <= row_of[s].proposed and picked[s] == row_of[s].tokens[position]}
        if not alive:
            return picked, logprobs, verified
        for s, history in alive.items():  # its draw equalled its proposal: accepted
            verified[at[speculating[s]]].append(logprobs[s])
            history.output.append(row_of[s].tokens[position])
        order = list(alive)
        at_position = logits[[starts[speculating[s]] + position for s in order]]
        tokens, token_logprobs = _pick(at_position, [alive[s] for s in order], order, position, taken, masks)
        for s, token, token_lp in zip(order, tokens, token_logprobs):
            picked[s], logprobs[s] = token, token_lp
        position += 1


def _pick(logits: torch.Tensor, histories: list[History], samplers: list[int], position: int,
          taken: dict[int, list[int]], masks: StepMasks | None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The token of each sampler (logits and history in the same order) at `position` of its row: a forced
    one taken as it is, the others drawn, under their grammar's mask at that position where they have one."""
    forced = [j for j, s in enumerate(samplers) if position < len(taken.get(s, ()))]
    drawn = [j for j, s in enumerate(samplers) if position >= len(taken.get(s, ()))]
    tokens: list[int] = [0] * len(samplers)
    logprobs: list[TokenLogprobs | None] = [None] * len(samplers)
    if forced:
        chosen = [taken[samplers[j]][position] for j in forced]
        chosen_logprobs = take_forced(logits[forced], [histories[j] for j in forced], chosen)
        for j, token, token_lp in zip(forced, chosen, chosen_logprobs):
            tokens[j], logprobs[j] = token, token_lp
    if drawn:
        under = [] if masks is None else [k for k, j in enumerate(drawn) if samplers[j] in masks.first]
        allowed = None
        if under:  # the mask of each drawn row's position; a free row's is never read, so it takes the first
            # (its position can pass every mask there is: a free row verifies runs longer than the constrained ones')
            index = [masks.first[s] + position - len(taken.get(s, ())) if s in masks.first else 0
                     for s in (samplers[j] for j in drawn)]
            allowed = masks.bits[index]
        x = logits if len(drawn) == len(samplers) else logits[drawn]
        for j, token, token_lp in zip(drawn, *sample_rows(x, [histories[j] for j in drawn], allowed, under)):
            tokens[j], logprobs[j] = token, token_lp
    return tokens, logprobs
