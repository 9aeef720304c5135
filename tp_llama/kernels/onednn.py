"""oneDNN's blocked weight layout, for CPUs without tp_llama's C kernels.

Faster than PyTorch's default matmul for batches of rows: the weight is laid out in oneDNN's
blocks once, at load (bench/kernels/matmul.py). oneDNN builds and keeps a kernel per row count, so
row counts are rounded up to a few sizes (exact up to EXACT_ROWS, then multiples of it): the
decode sizes are built at load (`warm_up`), the few prefill sizes when first met.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EXACT_ROWS = 32


def available(dtype: torch.dtype) -> bool:
    """Packed weights of this dtype can be had: bfloat16 ones need avx512bw/vl/dq or avx_ne_convert
    (on AVX2-only CPUs such as AMD's Zen 2/3 PyTorch refuses to pack them)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prepare(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), EXACT_ROWS)


def padded_rows(rows: int) -> int:
    return rows if rows <= EXACT_ROWS else -(-rows // EXACT_ROWS) * EXACT_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return out if padded == rows else out[:rows]


@torch.inference_mode()
def warm_up(weights: list[torch.Tensor], max_rows: int, dtype: torch.dtype) -> None:
    """Build oneDNN's kernel for every decode batch size (up to max_rows), now rather than mid-serving."""
    sizes = sorted({padded_rows(rows) for rows in range(1, min(max_rows, EXACT_ROWS) + 1)})
    shapes = {tuple(w.shape): w for w in weights}
    for weight in shapes.values():  # kernels depend on shapes, not values
        for rows in sizes:
            linear(torch.zeros(rows, weight.shape[1], dtype=dtype), weight)
