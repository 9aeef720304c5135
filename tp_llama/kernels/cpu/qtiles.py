"""Weights quantized at load into the C kernels' integer tiles (quant.c), and their matmul.

Each weight is quantized per group of QBLOCK along k, in C (every worker start pays for it):
int8 symmetric with an fp16 scale a group (llama.cpp's Q8_0), int4 with an fp16 scale and minimum
a group (Q4_1's block), refit by least squares where that lowers the group's error. Activations are
quantized per row and group inside each matmul, so a row's outputs do not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tp_llama.kernels.cpu.ffi import library
from tp_llama.pages import huge_empty

ROWS_AT_ONCE = 4096  # rows quantized and packed at a time (a multiple of TILE_COLS)
REFITS = 4  # least-squares rounds for each group's scale (and int4's minimum; see quantize_groups)


@dataclass(frozen=True)
class QuantTiled:
    """A weight [out, in] (`shape`) quantized to `bits` in quant.c's tiles (`data`, bytes); gated:
    a SwiGLU's w1 and w3 interleaved in runs of GATE_RUN, as ops.Tiled."""

    data: torch.Tensor
    shape: tuple[int, int]
    bits: int
    gated: bool = False


def group_size() -> int:
    return library().constants["QBLOCK"]


def quantize_groups(weight: torch.Tensor, bits: int, refits: int = REFITS) -> tuple[torch.Tensor, ...]:
    """(q [out, in] int8 (int4: values 0..15), scales [out, in / QBLOCK] float16, and for int4 the
    minimums alike): w = q * scale (+ minimum). The weight must be float32 or bfloat16, its k a
    multiple of QBLOCK."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    w = weight.detach().contiguous()
    if w.dtype not in (torch.float32, torch.bfloat16):
        w = w.float()
    out, k = w.shape
    group = group_size()
    if k % group:
        raise ValueError(f"a quantized weight's k must be a multiple of {group}, not {k}")
    q = torch.empty((out, k), dtype=torch.int8)
    scales = torch.empty((out, k // group), dtype=torch.float16)
    mins = torch.empty_like(scales) if bits == 4 else scales  # int8 writes no minimums
    library().quantize_groups(w.data_ptr(), out, k, w.dtype == torch.bfloat16, bits, refits, q.data_ptr(),
                              scales.data_ptr(), mins.data_ptr())
    return (q, scales, mins) if bits == 4 else (q, scales)


def pack(groups: tuple[torch.Tensor, ...], bits: int, gated: bool = False) -> QuantTiled:
    """quantize_groups' output in tiles, on 2 MiB pages where Linux gives them (tp_llama.pages)."""
    data = _tiles(groups[0].shape, bits)
    _pack_into(groups, bits, data.data_ptr())
    return QuantTiled(data, tuple(groups[0].shape), bits, gated)


def _tiles(shape: tuple[int, int], bits: int) -> torch.Tensor:
    lib = library()
    out, k = shape
    tiles = -(-out // lib.constants["TILE_COLS"])
    return huge_empty((tiles * (k // group_size()) * lib.quant_block_bytes(bits),), torch.uint8)


def _pack_into(groups: tuple[torch.Tensor, ...], bits: int, address: int) -> None:
    q, scales = groups[0].contiguous(), groups[1].contiguous()  # C reads them row by row
    mins = groups[2].contiguous() if bits == 4 else scales
    library().pack_quant_tiles(q.data_ptr(), scales.data_ptr(), mins.data_ptr(), q.shape[0], q.shape[1], bits, address)


def pack_pairs(q: torch.Tensor, scales: torch.Tensor) -> QuantTiled:
    """int8 q [out, in] with fp16 scales [out, in / QBLOCK] (w = q * scale) in quant.c's pair tiles, whose
    matmul quantizes its inputs to int16 (bits Q8_PAIRS), ROWS_AT_ONCE rows at a time."""
    lib = library()
    cols, block, bits = lib.constants["TILE_COLS"], group_size(), lib.constants["Q8_PAIRS"]
    out, k = q.shape
    data = _tiles((out, k), bits)
    tiles = data.view(-1, k // block, lib.quant_block_bytes(bits))  # [tiles, blocks, bytes]
    for first in range(0, out, ROWS_AT_ONCE):
        rows = slice(first, min(first + ROWS_AT_ONCE, out))
        pad = -(rows.stop - rows.start) % cols
        part = F.pad(q[rows], (0, 0, 0, pad)).view(-1, cols, k // block, block // 2, 2).permute(0, 2, 3, 1, 4)
        scale = F.pad(scales[rows], (0, 0, 0, pad)).view(-1, cols, k // block).transpose(1, 2)
        at = tiles[first // cols : first // cols + part.shape[0]]
        at[..., : 2 * cols] = scale.contiguous().view(torch.uint8)
        at[..., 2 * cols :] = part.reshape(part.shape[0], k // block, -1).view(torch.uint8)
    return QuantTiled(data, (out, k), bits)


def prepare_quant_tiles(weight: torch.Tensor, bits: int, gated: bool = False) -> QuantTiled:
    """weight [out, in] quantized to `bits` in tiles, ROWS_AT_ONCE rows at a time: a load then holds the
    16-bit weight and its tiles, not a whole int8 copy between them too (bench/engine/memory.py)."""
    lib = library()
    out, k = weight.shape
    data = _tiles((out, k), bits)
    tile_bytes = k // group_size() * lib.quant_block_bytes(bits)
    for first in range(0, out, ROWS_AT_ONCE):
        groups = quantize_groups(weight[first : first + ROWS_AT_ONCE], bits)
        _pack_into(groups, bits, data.data_ptr() + first // lib.constants["TILE_COLS"] * tile_bytes)
    return QuantTiled(data, (out, k), bits, gated)


def prepare_quant_swiglu(w1: torch.Tensor, w3: torch.Tensor, bits: int) -> QuantTiled | None:
    """w1 and w3 [ffn, in] as one gated quantized weight, or None where the FFN's width does not allow it."""
    run = library().constants["GATE_RUN"]
    ffn, cols = w1.shape
    if ffn % run:
        return None
    runs = [w.detach().reshape(ffn // run, run, cols) for w in (w1, w3)]
    return prepare_quant_tiles(torch.stack(runs, dim=1).reshape(2 * ffn, cols), bits, gated=True)


def quant_linear(x: torch.Tensor, weight: QuantTiled) -> torch.Tensor:
    """x [..., in] (float32 or bfloat16, CPU) @ weight.T (or the gated product), in x's dtype."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise TypeError(f"a quantized CPU weight got {x.dtype} input on {x.device}")
    out_features, in_features = weight.shape
    x = x.contiguous()
    rows = x.numel() // in_features
    y = torch.empty((*x.shape[:-1], out_features // 2 if weight.gated else out_features), dtype=x.dtype)
    if rows and library().quant_linear(x.data_ptr(), rows, in_features, weight.data.data_ptr(), out_features,
                                       y.data_ptr(), weight.gated, x.dtype == torch.bfloat16, weight.bits):
        raise MemoryError(f"no memory to quantize {rows} x {in_features} inputs")
    return y
