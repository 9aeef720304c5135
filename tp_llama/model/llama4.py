"""Llama 4's text transformer (Scout, Maverick): Llama's blocks with iRoPE attention and routed experts.

What differs from Llama 2/3 (llama-models 0.3.0's `llama4/model.py` and `moe.py` are the reference):
- attention: every `nope_layer_interval`-th layer has no RoPE and attends over the whole sequence, its
  query scaled up with the position (temperature tuning, which leaves short contexts alone); the
  others apply RoPE, then an RMSNorm without weight to q and k, and attend only within their block of
  `attention_chunk_size` absolute positions;
- feed-forward: every `interleave`-th layer is a mixture of experts: a router picks one expert per
  token, whose input is scaled by the sigmoid of its score, beside a shared expert every token runs.

Under tensor parallelism each rank holds every expert with its slice of their width, as Meta's files
do, so routing needs no exchange: the shared and routed partial sums are added, then all-reduced once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tp_llama.model.args import ModelArgs
from tp_llama.model.batch import Batch
from tp_llama.model.kv_cache import KVCache, attend
from tp_llama.model.llama import Attention, FeedForward, RMSNorm, TransformerBlock, apply_rope


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over each head without a weight, in float32 (Meta's QK-norm)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def temperature_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """The query's factor at each position: 1 below floor_scale, growing with log(position / floor_scale)."""
    return torch.log(torch.floor((positions.float() + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0


@dataclass(frozen=True)
class IRoPE:
    """What a layer of iRoPE does between its projections and attention (model/llama4.py's docstring)."""

    rope: bool
    qk_norm_eps: float | None
    window: int | None  # attention within blocks of this many absolute positions (None: global)
    temperature: tuple[float, float] | None  # (floor_scale, attn_scale) of the query's scaling by position

    @classmethod
    def of_layer(cls, args: ModelArgs, layer: int) -> IRoPE:
        nope = args.is_nope_layer(layer)
        return cls(not nope, args.norm_eps if args.use_qk_norm and not nope else None,
                   None if nope else args.attention_chunk_size,
                   (args.floor_scale, args.attn_scale) if args.attn_temperature_tuning and nope else None)

    def attend(self, cache: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation: torch.Tensor,
               batch: Batch) -> torch.Tensor:
        """Attention [T, heads, hd] of the batch's tokens from their projections q, k, v [T, heads, hd]."""
        q, k = self.query_and_key(q, k, rotation, batch)
        return attend(cache, q, k, v, batch, window=self.window)

    def query_and_key(self, q: torch.Tensor, k: torch.Tensor, rotation: torch.Tensor,
                      batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [T, heads, hd] as this layer attends with them: rotated, normed, q scaled by position."""
        if self.rope:
            q, k = apply_rope(q, rotation), apply_rope(k, rotation)
        if self.qk_norm_eps is not None:
            q, k = unit_rms_norm(q, self.qk_norm_eps), unit_rms_norm(k, self.qk_norm_eps)
        if self.temperature is not None:
            q = (q * temperature_scales(batch.positions, *self.temperature).view(-1, 1, 1)).to(q.dtype)
        return q, k


def attention_windows(model: nn.Module) -> tuple[int, ...]:
    """The window sizes the model's layers attend within (none for Llama 2/3), for a step's block masks."""
    return tuple(sorted({layer.attention.irope.window for layer in model.layers
                         if getattr(getattr(layer.attention, "irope", None), "window", None)}))


class Llama4Attention(Attention):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args)
        self.irope = IRoPE.of_layer(args, layer)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, batch: Batch) -> torch.Tensor:
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)) for w in (self.wq, self.wk, self.wv))
        return self.wo(self.irope.attend(self.cache, q, k, v, rotation, batch).flatten(1))


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, one tensor each, in x @ W order as Meta stores them: w1[e], w3[e]
    [dim, F], w2[e] [F, dim] (F: this rank's slice of the width under tensor parallelism). Apart, so that a
    load prepares and drops them one expert at a time (backend/llama4.py)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        e, d, f = args.moe.experts, args.dim, args.moe.expert_dim
        self.w1 = nn.ParameterList(torch.empty(d, f) for _ in range(e))
        self.w3 = nn.ParameterList(torch.empty(d, f) for _ in range(e))
        self.w2 = nn.ParameterList(torch.empty(f, d) for _ in range(e))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return (F.silu(x @ self.w1[expert]) * (x @ self.w3[expert])) @ self.w2[expert]


class MoE(nn.Module):
    """Top-1 routed experts beside a shared expert. Each expert runs only its own tokens (Meta's reference
    runs every expert on every token, the others' inputs zeroed, which gives the same sums)."""

    group: dist.ProcessGroup | None = None  # the ranks whose partial sums make the output (set by the loader)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.router_DE = nn.Parameter(torch.empty(args.dim, args.moe.experts))
        self.shared_expert = FeedForward(args, args.moe.expert_dim)
        self.experts = Experts(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return route(x, x @ self.router_DE, self.shared_expert, each_expert(self.experts), self.group)


def route(x: torch.Tensor, scores: torch.Tensor, shared: nn.Module,
          experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], group: dist.ProcessGroup | None,
          counts: torch.Tensor | None = None) -> torch.Tensor:
    """Top-1 routing of x [T, dim] by its router scores [T, E]: the shared expert's output plus each token's
    chosen expert's (experts(routed, chosen)), on its input scaled by the sigmoid of its score; all-reduced
    over `group`. counts [E]: the tokens each expert was given, added to."""
    score, chosen = scores.max(dim=-1)
    if counts is not None:  # a scatter, not bincount, whose output size waits for the device
        counts.scatter_add_(0, chosen, torch.ones_like(chosen))
    out = shared(x)
    out += experts(x * sigmoid(score).to(x.dtype).unsqueeze(-1), chosen)
    if group is not None:
        dist.all_reduce(out, group=group)
    return out


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in float32, each value's bits its own: torch.sigmoid's CPU kernel computes the elements
    past its last whole pair of vectors by another formula, so a token's gate would move with the step's size
    (tests/test_batch_invariance.py); torch.exp maps every element through the same vector code."""
    return 1 / (1 + torch.exp(-x.float()))


def each_expert(run: Callable[[torch.Tensor, int], torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Experts run one at a time on their own rows: each chosen expert's weights read once, in whichever form
    `run(rows, expert)` holds them; listing the chosen experts waits for the device."""
    def experts(routed: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(routed)
        for expert in chosen.unique().tolist():
            rows = (chosen == expert).nonzero().squeeze(1)
            out.index_add_(0, rows, run(routed[rows], expert))
        return out
    return experts


def grouped_experts(w13: torch.Tensor, w2: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Experts in two grouped matmuls over the rows sorted by expert (w13 [E, dim, 2F]: w1 then w3; w2 [E, F,
    dim]): static shapes and no host sync, so a CUDA graph can hold them."""
    def experts(routed: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        order = chosen.argsort(stable=True)
        ends = torch.zeros(w13.shape[0], dtype=torch.long, device=chosen.device).scatter_add_(
            0, chosen, torch.ones_like(chosen)).cumsum(0).to(torch.int32)
        gate, up = F.grouped_mm(routed[order], w13, offs=ends).chunk(2, dim=-1)
        out = F.grouped_mm(F.silu(gate) * up, w2, offs=ends)
        return torch.empty_like(out).index_copy_(0, order, out)
    return experts


class Llama4Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention = Llama4Attention(args, layer)
        self.feed_forward = MoE(args) if args.is_moe_layer(layer) else FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    forward = TransformerBlock.forward

