"""Fused projections for serving, on any device: q/k/v as one matmul, w1/w3 as one.

Each module replaces the model's own after it is built and loaded (inference only: Meta's
separate projections are gone afterwards), with every weight in the form `kind` of matmul runs
fastest (tp_llama.kernels.prepare); quantized kinds pack their weights for `device`, where the
model is going.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tp_llama.kernels import Weight, linear, prepare
from tp_llama.model.batch import Batch
from tp_llama.model.kv_cache import attend
from tp_llama.model.llama import Attention, FeedForward, Transformer, apply_rope
from tp_llama.parallel.layout import NONE
from tp_llama.parallel.modules import LocalLinear


def held(weight: Weight) -> Weight:
    """A plain weight as a Parameter, so that moving the module to its device moves it too."""
    if isinstance(weight, torch.Tensor) and not weight.is_mkldnn:
        return nn.Parameter(weight, requires_grad=False)
    return weight


def serving_linear(module: nn.Module, kind: str, device: torch.device | None = None, bits: int = 16) -> LocalLinear:
    """A Linear (or this rank's LocalLinear) with its weight prepared for `kind` of matmul (quantized to `bits`)."""
    local = module if isinstance(module, LocalLinear) else LocalLinear(module.weight.detach(), NONE, None)
    if not isinstance(local.weight, torch.Tensor):  # a checkpoint's own quantized weight, in its kernel's form
        return local
    prepared = held(prepare(local.weight, kind, device, bits))
    del local.weight
    local.weight = prepared
    return local


class FusedAttention(nn.Module):
    """The model's attention with q, k and v in one matmul."""

    lora_qkv = None  # LoRA adapters' q/k/v delta (lora/slots.py's Projection), set on the instance where held

    def __init__(self, attention: Attention, kind: str, device: torch.device | None = None, bits: int = 16):
        super().__init__()
        self.head_dim = attention.head_dim
        self.widths = (attention.wq.weight.shape[0], attention.wk.weight.shape[0])  # this rank's q and k features
        fused = torch.cat([w.weight.detach() for w in (attention.wq, attention.wk, attention.wv)])
        self.wqkv: Weight = held(prepare(fused, kind, device, bits))
        self.wo = serving_linear(attention.wo, kind, device, bits)
        self.cache = attention.cache

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.wo(self.attend(self.qkv(x), rotation, batch))

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The fused q/k/v projection of x, with its adapters' deltas."""
        qkv = linear(x, self.wqkv)
        return qkv if self.lora_qkv is None else self.lora_qkv.add(qkv, x)

    def attend(self, qkv: torch.Tensor, rotation: torch.Tensor, batch: Batch, done: int = 0) -> torch.Tensor:
        """Attention [T, q features] of the batch's tokens from `done` on, from their fused projections."""
        n_q, n_kv = self.widths
        qk = apply_rope(qkv[:, : n_q + n_kv].unflatten(-1, (-1, self.head_dim)), rotation)
        q, k = qk.split([n_q // self.head_dim, n_kv // self.head_dim], dim=1)
        v = qkv[:, n_q + n_kv :].unflatten(-1, (-1, self.head_dim))
        return attend(self.cache, q, k, v, batch, done).flatten(1)


class FusedFeedForward(nn.Module):
    """The model's SwiGLU with w1 and w3 in one matmul."""

    lora_w13 = None  # LoRA adapters' w1/w3 delta (lora/slots.py's Projection), set on the instance where held

    def __init__(self, ffn: FeedForward, kind: str, device: torch.device | None = None, bits: int = 16):
        super().__init__()
        w13 = torch.cat([ffn.w1.weight.detach(), ffn.w3.weight.detach()])
        self.w13: Weight = held(prepare(w13, kind, device, bits))
        self.w2 = serving_linear(ffn.w2, kind, device, bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w13 = linear(x, self.w13)
        gate, up = (w13 if self.lora_w13 is None else self.lora_w13.add(w13, x)).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def apply_layer(block: nn.Module, kind: str, device: torch.device | None = None, bits: int = 16) -> None:
    """One block's projections fused, every matmul weight prepared for `kind` (on `device`), quantized to `bits`."""
    block.attention = FusedAttention(block.attention, kind, device, bits)
    block.feed_forward = FusedFeedForward(block.feed_forward, kind, device, bits)


def apply_top(model: Transformer, kind: str, device: torch.device | None = None, bits: int = 16) -> None:
    model.output = serving_linear(model.output, kind, device, bits)
