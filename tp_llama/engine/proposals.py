"""The tokens a step's decode rows carry after their newest one: a grammar's forced tokens first, then a
speculator's proposals, each within its sequence's limits and the pool's free blocks.

Forced tokens (engine/constraint.py) come whether or not speculative decoding is on: each is the only
token the row's grammar allows there, so the row takes it without a draw (engine/verify.py) and its
matcher moves past it here. The speculator's proposals after them are cut where the grammar refuses
one (llguidance's validate_tokens), so every proposal verified is one the grammar could take.
"""

from __future__ import annotations

from tp_llama.engine.blocks import BlockPool
from tp_llama.engine.sequence import Sequence
from tp_llama.engine.speculate import Speculator


def step_proposals(seqs: list[Sequence], most: int, spare: int, pool: BlockPool, speculator: Speculator | None,
                   max_seq_len: int) -> tuple[list[list[int]], list[int]]:
    """Each decode row's proposals, and how many of them lead as its grammar's forced tokens: those first,
    then the speculator's, at most `most` a row; `spare` in all. Blocks are taken for them now from the
    free ones (no sequence is preempted for a proposal). A draft model writes its KV cache as it
    proposes (the forced tokens first), so its rows get their blocks first."""
    proposals = []
    for seq in seqs:
        forced = seq.constraint.forced(room(seq, 0, spare, max_seq_len)) if seq.constraint is not None else []
        del forced[reserve(pool, seq, len(forced)) :]
        if forced:
            seq.constraint.advance(forced)
        spare -= len(forced)
        proposals.append(forced)
    counts = [len(forced) for forced in proposals]
    if speculator is None or most <= 0 or spare <= 0:
        return proposals, counts
    rooms, left = [], spare
    for seq, forced in zip(seqs, proposals):
        most_here = min(speculator.row_most(seq.id, most), room(seq, len(forced), left, max_seq_len))
        if not speculator.drafts:
            rooms.append(most_here)  # n-gram rows often propose nothing: cut below instead
            continue
        rooms.append(reserve(pool, seq, len(forced) + most_here) - len(forced))
        left -= rooms[-1]
    if not any(rooms):
        return proposals, counts
    for seq, forced, row in zip(seqs, proposals, speculator.propose_rows(seqs, rooms, proposals)):
        del row[spare:]
        del row[reserve(pool, seq, len(forced) + len(row)) - len(forced) :]
        if seq.constraint is not None:
            del row[seq.constraint.valid(row) :]
        spare -= len(row)
        forced += row
        keep = pool.blocks_for(seq.computed + 1 + len(forced))
        pool.release(seq.blocks[keep:])  # a draft's room its proposals did not fill
        del seq.blocks[keep:]
    return proposals, counts


def room(seq: Sequence, proposed: int, most: int, max_seq_len: int) -> int:
    """How many more proposals a decode row that carries `proposed` may take, at most `most`."""
    return max(0, min(most, seq.params.max_new_tokens - len(seq.output) - 1 - proposed,
                      max_seq_len - seq.computed - 2 - proposed))


def reserve(pool: BlockPool, seq: Sequence, proposals: int) -> int:
    """Blocks for a decode row's newest token and up to `proposals` more from the free ones; how many of
    those got them."""
    while proposals and len(seq.blocks) < pool.blocks_for(seq.computed + 1 + proposals):
        if pool.free:
            seq.blocks += pool.allocate(1)
        else:
            proposals -= 1
    return proposals
