"""Running a model under test on plain [B, S] token tensors, each row in a cache "slot": a fixed
run of blocks of the paged cache, so tests can address sequences by number."""

from __future__ import annotations

import torch
from torch import nn

from tp_llama.model import Batch

BLOCK = 16


def setup_slots(model: nn.Module, slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device,
                n_kv_heads: int | None = None, block_size: int = BLOCK) -> None:
    """A paged cache with room for `slots` sequences of max_seq_len, as slot_rows lays them out."""
    model.setup_caches(max_seq_len, slots * -(-max_seq_len // block_size), block_size, dtype, device, n_kv_heads)


def slot_blocks(model: nn.Module, slot: int, positions: int) -> list[int]:
    """The block table of `positions` positions of slot `slot`: its own run of blocks."""
    cache = model.layers[0].attention.cache
    per_slot = -(-model.rope.shape[0] // cache.block_size)
    return list(range(slot * per_slot, slot * per_slot + -(-positions // cache.block_size)))


def slot_batch(model: nn.Module, rows: list[tuple[int, int, list[int], bool]], device: torch.device | None = None,
               all_logits: bool = False) -> Batch:
    """rows: (slot, start position, tokens, want the logits of its last token), as one Batch."""
    cache = model.layers[0].attention.cache
    spec = [(start, ids, want, slot_blocks(model, slot, start + len(ids))) for slot, start, ids, want in rows]
    device = device or next(model.parameters()).device
    return Batch.build(spec, cache.block_size, cache.spare, device, all_logits=all_logits)


def dense_logits(model: nn.Module, tokens: torch.Tensor, start_pos: torch.Tensor, first_slot: int = 0,
                 last_only: bool = True) -> torch.Tensor:
    """Row b of tokens [B, S] at positions start_pos[b].. in slot first_slot + b, as one Batch.

    Returns logits [B, V] of each row's last position (or [B, S, V] with last_only=False), on the
    host whichever device the model runs on.
    """
    rows = [(first_slot + b, int(start), ids, True) for b, (start, ids) in
            enumerate(zip(start_pos.tolist(), tokens.tolist()))]
    logits = model(slot_batch(model, rows, all_logits=not last_only)).cpu()
    return logits if last_only else logits.view(*tokens.shape, logits.shape[-1])


def in_c_and_op_by_op(model: nn.Module, rows: list[tuple[int, int, list[int], bool]], label: str) -> list[int]:
    """One step of `rows` through the model's C decode layers (backend.cpu.DecodeLayers), then again from the
    same caches through the same blocks op by op: the logits and the cache writes must be the same bits,
    and the step must have written the caches. The greedy picks."""
    from tp_llama.model.llama import Layers

    caches = [t for layer in model.layers for t in (layer.attention.cache.k, layer.attention.cache.v)]
    batch = slot_batch(model, rows)
    before = [t.clone() for t in caches]
    in_c_layers = model.layers
    in_c = model(batch)
    written = [t.clone() for t in caches]
    for t, saved in zip(caches, before):
        t.copy_(saved)
    model.layers = Layers(in_c_layers)  # the same blocks, op by op
    try:
        op_by_op = model(batch)
    finally:
        model.layers = in_c_layers
    assert torch.equal(in_c, op_by_op), label
    assert all(torch.equal(a, b) for a, b in zip(written, caches)), label
    assert not all(torch.equal(a, b) for a, b in zip(written, before)), label
    return in_c.argmax(-1).tolist()


def steps_in_c_and_op_by_op(model: nn.Module, vocab: int) -> None:
    """in_c_and_op_by_op over a prefill of three prompts (43 rows: two of AMX's 32-row blocks), then three
    decode steps, the last beside a fourth prompt's prefill; the model needs 4 slots of 33 positions."""
    gen = torch.Generator().manual_seed(1)
    lengths = {0: 9, 2: 4, 3: 30}
    prefill = [(slot, 0, torch.randint(0, vocab, (n,), generator=gen).tolist(), True) for slot, n in lengths.items()]
    picked = in_c_and_op_by_op(model, prefill, "prefill")
    for step in range(3):  # slot 1 stays empty (a hole among the decode rows), then gets a prompt
        rows = [(slot, n + step, [token], True) for (slot, n), token in zip(lengths.items(), picked)]
        if step == 2:
            rows.append((1, 0, torch.randint(0, vocab, (20,), generator=gen).tolist(), True))
        picked = in_c_and_op_by_op(model, rows, f"step {step}")[:3]
