"""Serving modules for the blocks of a checkpoint Meta quantized (kernels/meta_int4.py's and kernels/fp8.py's
weights, put in by checkpoint.quantized as the block is read).

q/k/v fuse into one int4 weight and w1/w3 into another, which is exact: they share their input, so its
per-token quantization is the same, and the adaptors stack (A) and sit block-diagonal (B). Every int4
weight is packed for the kernels that run it: with the C kernels, their int4 tiles (the norms and
decode attention and SwiGLU theirs too, and without tensor parallelism a decode step's layers in one C
call, as with our own weights), elsewhere PyTorch's int4 op.
"""

from __future__ import annotations

import torch
from torch import nn

from tp_llama.backend.cpu import CAttention, CFeedForward, CRMSNorm
from tp_llama.backend.fused import FusedAttention, FusedFeedForward, held, serving_linear
from tp_llama.kernels import C_KINDS, Fp8Weight, Int4Weight, Weight, prepare
from tp_llama.kernels.cpu.ffi import library
from tp_llama.kernels.meta_int4 import fits_tiles, fuse_int4, pack, pack_tiles
from tp_llama.parallel.modules import LocalLinear

META_WEIGHTS = (Int4Weight, Fp8Weight)


def holds_meta_weights(block: nn.Module) -> bool:
    """Whether the block's linears hold a quantized checkpoint's own weights."""
    return any(isinstance(m, LocalLinear) and isinstance(m.weight, META_WEIGHTS) for m in block.modules())


def _packed(weight: Int4Weight, kind: str, device: torch.device, bf16: bool) -> Int4Weight:
    """The C kernels' int4 tiles where they run and hold the groups, PyTorch's int4 op elsewhere."""
    return pack_tiles(weight) if kind in C_KINDS and fits_tiles(weight) else pack(weight, device, bf16)


def _fused(weights: list[Weight], kind: str, device: torch.device, bf16: bool) -> Weight:
    """The weights' outputs side by side as one weight, prepared for `kind` on `device`."""
    if all(isinstance(w, Int4Weight) for w in weights):
        return _packed(fuse_int4(weights), kind, device, bf16)
    if all(isinstance(w, Fp8Weight) for w in weights) and all(len(w.slices) == 1 for w in weights):
        return Fp8Weight((sum(w.shape[0] for w in weights), weights[0].shape[1]),
                         [torch.cat([w.slices[0] for w in weights])],
                         [torch.cat([w.scales[0] for w in weights], dim=1)], weights[0].activation_ub)
    if all(isinstance(w, torch.Tensor) for w in weights):
        return held(prepare(torch.cat([w.detach() for w in weights]), kind, device))
    raise ValueError(f"cannot fuse weights of kinds {sorted({type(w).__name__ for w in weights})}")


def _serving(module: nn.Module, kind: str, device: torch.device, bf16: bool) -> LocalLinear:
    """A row-parallel layer (wo, w2) with its weight packed or prepared, its collective kept."""
    weight = module.weight
    if isinstance(weight, Int4Weight):
        module.weight = _packed(weight, kind, device, bf16)
        return module
    if isinstance(weight, Fp8Weight):
        return module
    return serving_linear(module, kind, device)


def _fused_attention(cls: type, attention: nn.Module, kind: str, device: torch.device,
                     bf16: bool) -> FusedAttention:
    """An instance of `cls` (FusedAttention or CAttention) over the block's own projections."""
    fused = cls.__new__(cls)
    nn.Module.__init__(fused)
    fused.head_dim = attention.head_dim
    fused.widths = (attention.wq.weight.shape[0], attention.wk.weight.shape[0])
    fused.wqkv = _fused([attention.wq.weight, attention.wk.weight, attention.wv.weight], kind, device, bf16)
    fused.wo = _serving(attention.wo, kind, device, bf16)
    fused.cache = attention.cache
    return fused


def _fused_feed_forward(ffn: nn.Module, kind: str, device: torch.device, bf16: bool) -> nn.Module:
    """w1/w3 as one weight; with the C kernels SwiGLU in C too, as their decode layers run it."""
    w13, w2 = _fused([ffn.w1.weight, ffn.w3.weight], kind, device, bf16), _serving(ffn.w2, kind, device, bf16)
    if kind in C_KINDS:
        return CFeedForward(w13, w2)
    fused = FusedFeedForward.__new__(FusedFeedForward)
    nn.Module.__init__(fused)
    fused.w13, fused.w2 = w13, w2
    return fused


def apply_layer(block: nn.Module, kind: str, device: torch.device) -> None:
    """One block's serving modules for `kind` of matmul on `device` (the C kernels' norms and decode
    attention where kind is theirs); a bfloat16 model's int4 weights take bfloat16 inputs (kernels.meta_int4.pack)."""
    bf16 = block.attention_norm.weight.dtype == torch.bfloat16
    c_kernels = kind in C_KINDS
    c_attention = c_kernels and block.attention.head_dim <= library().constants["MAX_HEAD_DIM"]
    block.attention = _fused_attention(CAttention if c_attention else FusedAttention, block.attention, kind, device,
                                       bf16)
    block.feed_forward = _fused_feed_forward(block.feed_forward, kind, device, bf16)
    if c_kernels:
        block.attention_norm, block.ffn_norm = CRMSNorm(block.attention_norm), CRMSNorm(block.ffn_norm)
