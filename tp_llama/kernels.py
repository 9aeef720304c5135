"""Matmuls on weights prepared for the device: oneDNN-packed on CPU, plain elsewhere.

On a CPU, oneDNN's blocked weight layout is 15-35% faster than PyTorch's default matmul for
batches of rows, and for bfloat16 at every batch size (measured on the bench models' weight
shapes; BENCHMARKS.md has what it does to a whole step). The packed weight replaces the plain
one, so it costs no memory of its own. oneDNN builds and keeps a kernel per row count, so row
counts are rounded up to a few sizes (exact up to a decode batch of EXACT_ROWS, then multiples
of it): the kernels it keeps are bounded. The decode sizes are built at load, the few prefill
sizes when first met (building them all at load took most of a 1 GB model's bring-up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EXACT_ROWS = 32


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's layout for x @ weight.T (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), EXACT_ROWS)


def padded_rows(rows: int) -> int:
    return rows if rows <= EXACT_ROWS else -(-rows // EXACT_ROWS) * EXACT_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ weight.T, whichever form the weight is in."""
    if not weight.is_mkldnn:
        return F.linear(x, weight)
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
    shapes = {tuple(w.shape): w for w in weights if w.is_mkldnn}  # kernels depend on shapes, not values
    for weight in shapes.values():
        for rows in sizes:
            linear(torch.zeros(rows, weight.shape[1], dtype=dtype), weight)
