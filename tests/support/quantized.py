"""Quantized weights for the tests: a weight with hard groups, and the definitions the C kernels'
int8/int4 groups and quantized inputs are checked against, in float64."""

from __future__ import annotations

import torch

from tp_llama.kernels.quant import INT4_GROUP


def weight(out: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=gen)
    w[0] *= 30  # rows and groups of very different ranges
    w[1, :INT4_GROUP] = 0.5  # a constant group: its range is zero
    return w


def groups_of(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], -1, INT4_GROUP)


def dequantize_groups(groups: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The float64 weight the C kernels' groups stand for: q * scale (+ minimum), a scale a group."""
    q, scales = groups[0].double(), groups[1].double()
    w = groups_of(q) * scales[..., None]
    if len(groups) == 3:
        w = w + groups[2].double()[..., None]
    return w.reshape(q.shape)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the C kernels quantize a matmul's input, in float64: each row's groups of 32 to
    round(x / d) * d with d = max |x| / 127."""
    blocks = x.double().reshape(*x.shape[:-1], -1, INT4_GROUP)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    return torch.where(step > 0, (blocks / step).round() * step, 0).reshape(x.shape)
