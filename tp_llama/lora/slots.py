"""A rank's resident LoRA adapters, in fixed slots per fused projection, and their per-row deltas.

Each adapted projection of a layer holds one A [slots, R, K] and one B^T [slots, R, N] in the model's
type (deltas are summed in float32), slot 0 all zeros (the base), so a step may mix rows of any
adapters and the base, and the tensors' shapes never change with the adapters loaded. A fused
projection (q/k/v, w1/w3) stacks its parts' A along R (part j at ranks j * max_rank on) and its B^T
is block-diagonal, so one delta serves the fused matmul's output; the C kernels read only the blocks
(block_lines). The shards are this rank's: a column-parallel part's B rows and a row-parallel one's
A columns, as the base weight is split (parallel/layout.py), so the existing all-reduce sums a
row-parallel adapter's partial outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tp_llama.kernels.cpu import ops
from tp_llama.model.args import ModelArgs
from tp_llama.parallel.layout import tp_sharding

if TYPE_CHECKING:
    from tp_llama.lora.adapters import Adapter

# Each fused projection of a served layer and the Meta modules it fuses, in its output order.
PROJECTIONS = {"qkv": ("wq", "wk", "wv"), "wo": ("wo",), "w13": ("w1", "w3"), "w2": ("w2",)}
MODULE_NAMES = {"wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo",
                "w1": "feed_forward.w1", "w3": "feed_forward.w3", "w2": "feed_forward.w2"}


@dataclass(frozen=True)
class AdapterRef:
    """What the scheduler needs of a resident adapter: its slot, and its weights' digest (the prefix cache's
    salt: a block computed under one adapter's weights is never served to another's rows)."""

    name: str
    slot: int
    digest: str


@dataclass
class SlotWeights:
    """One projection's adapters: a [slots, R, K], bt [slots, R, N] in the model's type; lines: each 16 columns'
    ranks where bt may be other than zero (block_lines); c: the C kernels' view of them
    (kernels.cpu.ops.lora_weights), where the C layers run this projection."""

    a: torch.Tensor
    bt: torch.Tensor
    lines: tuple[torch.Tensor, int]
    c: Any = None


@dataclass
class LoraStep:
    """The adapter slot of each token of the forward under way (None: every token on the base), and the
    tokens of each slot in use, set by the runner before each forward; or, in a decode step of static shapes
    (engine/decode_step.py), `rows`: each row's slot as a device tensor the step's graph reads."""

    slots: torch.Tensor | None = None  # int32 [tokens]
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (slot, token indices)
    rows: torch.Tensor | None = None

    def begin(self, slots: torch.Tensor | None, groups: list[tuple[int, torch.Tensor]]) -> None:
        self.slots, self.groups, self.rows = slots, groups, None


@dataclass
class Projection:
    """An adapted projection's slots and the step they are read in: the hook a serving module calls after
    its base matmul, before any collective."""

    weights: SlotWeights
    step: LoraStep

    def add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y[t] += (x[t] A^T) B^T for each token t on an adapter, in float32 and rounded once to y's type;
        each adapter's A and B read once for all its tokens."""
        if self.step.rows is not None:
            return self._add_every_slot(y, x, self.step.rows)
        if self.weights.c is not None and self.step.groups and x.dtype == y.dtype and y.is_contiguous():
            # The C kernels' copy (lora.c), which decode steps read too: a token's delta has the same bits in
            # a prompt step as in a decode step, and no slot is converted to float32 per call.
            ops.lora_add(x.contiguous(), self.step.slots, self.weights.c, y)
            return y
        for slot, rows in self.step.groups:
            delta = (x[rows].float() @ self.weights.a[slot].float().t()) @ self.weights.bt[slot].float()
            y[rows] = (y[rows].float() + delta).to(y.dtype)
        return y

    def _add_every_slot(self, y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The same deltas with no host-side grouping, for a graph whose shapes never change: x through every
        slot's A, each row keeping its own slot's part (the base's slot holds zeros), then one matmul by every
        slot's B^T. It costs the slots' count in small matmuls, and it never gathers a row's factors."""
        a, bt = self.weights.a.float(), self.weights.bt.float()
        count, rank = a.shape[0], a.shape[1]
        t = (x.float() @ a.flatten(0, 1).t()).unflatten(1, (count, rank))
        own = (torch.arange(count, device=x.device) == slots[: len(x)].unsqueeze(1)).unsqueeze(-1)
        return (y.float() + (t * own).flatten(1) @ bt.flatten(0, 1)).to(y.dtype)


def tile_order(ffn: int, run: int) -> torch.Tensor:
    """Where each of w1/w3's 2 * ffn natural output columns (w1's, then w3's) lands in a gated matmul's
    output: tiles of `run` w1 columns then `run` w3 columns (kernels/cpu/api.h's GATE_RUN)."""
    cols = torch.arange(ffn)
    tile, within = cols // run, cols % run
    return torch.cat([tile * 2 * run + within, tile * 2 * run + run + within])


def block_lines(name: str, widths: dict[str, tuple[int, int]], max_rank: int,
                gated_run: int | None) -> tuple[torch.Tensor, int]:
    """For each 16 output columns of a projection's B^T, the first of the ranks that may be other than zero
    there, and how many: a fused projection's parts' blocks (w1/w3's columns in the gated tiles' order where
    gated_run is set), every rank for one part."""
    parts = PROJECTIONS[name]
    owner = torch.cat([torch.full((widths[m][1],), j) for j, m in enumerate(parts)])
    if name == "w13" and gated_run is not None:
        owner = owner[torch.argsort(tile_order(len(owner) // 2, gated_run))]
    vectors = owner.split(16)
    first = torch.tensor([int(v.min()) * max_rank for v in vectors], dtype=torch.int32)
    lines = max(max_rank * (int(v.max()) - int(v.min()) + 1) for v in vectors)
    return first.clamp(max=max_rank * len(parts) - lines), lines


def local_widths(args: ModelArgs, world: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Meta module on one rank."""
    q, kv, ffn = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    return {"wq": (args.dim, q // world), "wk": (args.dim, kv // world), "wv": (args.dim, kv // world),
            "wo": (q // world, args.dim), "w1": (args.dim, ffn // world), "w3": (args.dim, ffn // world),
            "w2": (ffn // world, args.dim)}


def shard(a: torch.Tensor, b: torch.Tensor, module: str, family: str, rank: int,
          world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of one module: split as the base weight is (its output rows or input columns)."""
    dim = tp_sharding(f"layers.0.{MODULE_NAMES[module]}", family).dim
    if world == 1 or dim is None:
        return a, b
    if dim == 0:
        return a, b.chunk(world, dim=0)[rank]
    return a.chunk(world, dim=1)[rank], b


def allocate_slots(adapters: list[Adapter], args: ModelArgs, max_rank: int, world: int, slots: int,
                   every_projection: bool, dtype: torch.dtype,
                   gated_run: int | None = None) -> list[dict[str, SlotWeights]]:
    """Per layer, zeroed slots of each projection some adapter adapts (every projection where adapters may come
    later: runtime loading, or more adapters than slots), slot 0 the base's, in `dtype`; gated_run as
    write_slot's."""
    widths = local_widths(args, world)
    lines = {name: block_lines(name, widths, max_rank, gated_run) for name in PROJECTIONS}
    layers: list[dict[str, SlotWeights]] = []
    for layer in range(args.n_layers):
        projections = {}
        for name, parts in PROJECTIONS.items():
            if every_projection or any((layer, m) in adapter.weights for adapter in adapters for m in parts):
                k, n = widths[parts[0]][0], sum(widths[m][1] for m in parts)
                projections[name] = SlotWeights(torch.zeros(slots, max_rank * len(parts), k, dtype=dtype),
                                                torch.zeros(slots, max_rank * len(parts), n, dtype=dtype),
                                                lines[name])
        layers.append(projections)
    return layers


def write_slot(layers: list[dict[str, SlotWeights]], slot: int, adapter: Adapter | None, args: ModelArgs,
               max_rank: int, rank: int, world: int, gated_run: int | None = None) -> None:
    """Slot `slot` of every projection becomes this rank's shards of `adapter` (None: zeros), in place, so the
    C layers' pointers stay good. gated_run: the w1/w3 matmul ends in SwiGLU on tiles of this many columns of
    each (the C kernels), so its B^T columns go in that interleaved order, which the matmul writes first."""
    widths = local_widths(args, world)
    for layer, projections in enumerate(layers):
        for name, weights in projections.items():
            parts = PROJECTIONS[name]
            a, bt = torch.zeros_like(weights.a[slot]), torch.zeros_like(weights.bt[slot])
            at = 0
            for j, module in enumerate(parts):
                if adapter is not None and (layer, module) in adapter.weights:
                    part_a, part_b = shard(*adapter.weights[(layer, module)], module, args.family, rank, world)
                    r = part_a.shape[0]
                    a[j * max_rank : j * max_rank + r] = part_a
                    bt[j * max_rank : j * max_rank + r, at : at + part_b.shape[0]] = part_b.t()
                at += widths[module][1]
            if name == "w13" and gated_run is not None:
                bt = bt[:, torch.argsort(tile_order(bt.shape[1] // 2, gated_run))]
            weights.a[slot].copy_(a)
            weights.bt[slot].copy_(bt)
