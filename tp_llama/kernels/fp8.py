"""The matmuls of Meta's fp8 checkpoints (Llama 3.1 405B): float8 e4m3 weights, one float32 scale per row
of each k slice (a checkpoint shard's columns). On CUDA GPUs with float8 matmuls they run through
torch._scaled_mm, each input row quantized to float8 with its own scale (its largest magnitude, capped at
`activation_ub`). Elsewhere the loader reads them as float32, scales them and serves them in the model's
dtype (checkpoint/quantized.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # float8 e4m3's largest finite value
FP8_ACTIVATION_UB = 1200.0  # Meta's cap on an input row's largest magnitude before its fp8 scale


@dataclass
class Fp8Weight:
    """A weight [out, k] in float8 e4m3 on a CUDA device: `slices` (one contiguous float8 tensor [out,
    k_i] per k slice) and `scales` (float32 [1, out] per slice), w = data * scale per row of a slice."""

    shape: tuple[int, int]
    slices: list[torch.Tensor]
    scales: list[torch.Tensor]
    activation_ub: float = FP8_ACTIVATION_UB


def fp8_matmuls(device: torch.device) -> bool:
    """Whether `device` runs torch._scaled_mm on float8 (CUDA, compute capability 8.9 and up)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [..., k] @ weight^T on CUDA: each k slice's input rows quantized to float8 with a scale each
    (the row's largest magnitude, capped at activation_ub, over FP8_MAX), the products in bfloat16."""
    out, k = weight.shape
    flat = x.reshape(-1, k)
    y = None
    start = 0
    for data, scales in zip(weight.slices, weight.scales):
        part = flat[:, start : start + data.shape[1]].float()
        start += data.shape[1]
        top = part.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12, max=weight.activation_ub)
        x_scale = top / FP8_MAX
        xq = (part / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        product = torch._scaled_mm(xq, data.t(), scale_a=x_scale, scale_b=scales, out_dtype=torch.bfloat16,
                                   use_fast_accum=True)
        y = product if y is None else y + product
    return y.to(x.dtype).reshape(*x.shape[:-1], out)
