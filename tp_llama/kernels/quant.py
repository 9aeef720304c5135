"""Weights quantized at load for PyTorch's own matmuls (CUDA, and CPUs without the C kernels, whose
integer tiles are kernels/cpu/qtiles.py): int8 per output channel, int4 per group of k.

- int8: symmetric, one scale per output row (w = q * scale, q in -127..127), as gpt-fast's
  `WeightOnlyInt8Linear`; the matmul is PyTorch's `_weight_int8pack_mm` on CPU, and on CUDA the
  int8 weight widened inside the matmul's graph (torch.compile fuses it), the scale applied after.
- int4: a scale and a minimum per group of INT4_GROUP along k (w = q * scale + min, q in 0..15),
  llama.cpp's Q4_1 and tinygemm's layout; the matmul is PyTorch's `_weight_int4pack_mm_for_cpu`
  (CPU) or `_weight_int4pack_mm` (CUDA), which take the minimum as a zero point at q = 8.

Each rank quantizes its own slice of a weight, so a group never spans two tensor-parallel shards;
a slice whose k a group does not divide is refused (`check_groups`). The int4 packing is the
device's own, so a weight is quantized for the device it will run on. Activations stay in the
serving dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUANTIZE = ("none", "int8", "int4")
BITS = {"none": 16, "int8": 8, "int4": 4}
INT4_GROUP = 32  # llama.cpp's block, and the C kernels' QBLOCK; every Llama layer's k (and its TP shards') is a multiple
INT4_INNER_K_TILES = 2  # the CPU packing's tiling of k; CUDA's tinygemm takes 2, 4 or 8
INT4_ROWS = 16  # the int4 packings take whole blocks of 16 output rows: others are padded with zeros


@dataclass
class Quantized:
    """A matmul weight [out, in] quantized to `bits` on the device that runs it: `data` in the layout
    its matmul reads, `scales` in the activations' dtype (int8: [out]; int4: [in / group, out, 2] of
    scale and zero point, tinygemm's layout)."""

    bits: int
    data: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    group: int


def check_groups(name: str, weight: torch.Tensor) -> None:
    """A group of k must not span two TP shards: this rank's k must be a multiple of the group (the
    C kernels group int8 too)."""
    k = weight.shape[1]
    if k % INT4_GROUP:
        raise ValueError(f"{name}: this rank's slice has k = {k}, which groups of {INT4_GROUP} do not divide; "
                         "quantized weights need a tensor-parallel size whose shards keep whole groups")


def quantize(weight: torch.Tensor, bits: int, device: torch.device | None = None) -> Quantized:
    """weight [out, in] (float) quantized, its matmul's layout on `device` (the weight's own by default)."""
    device = device or weight.device
    w = weight.detach().float()
    if bits == 8:
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        return Quantized(8, q.to(device), scales.to(weight.dtype).to(device), tuple(w.shape), w.shape[1])
    if bits != 4:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    out, k = w.shape
    w = F.pad(w, (0, 0, 0, -out % INT4_ROWS))  # zero rows, whose outputs are dropped
    groups = w.view(w.shape[0], k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32).view(-1, k)
    zeros = low + 8 * scales  # tinygemm's zero point: w = (q - 8) * scale + zero
    scales_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
    return Quantized(4, pack_int4(q, device), scales_zeros.to(device), (out, k), INT4_GROUP)


def pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int32 [out, in] of 4-bit values in the packing the int4 matmul on `device` reads (CUDA's op takes
    them two to a byte, the even column in the high nibble)."""
    if device.type == "cuda":
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), INT4_INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), INT4_INNER_K_TILES)


def unpack_int4(weight: Quantized) -> torch.Tensor:
    """The 4-bit values [out, in], read back by multiplying the identity (the packing is the op's own)."""
    out, k = weight.shape
    eye = torch.eye(k, dtype=weight.scales.dtype, device=weight.data.device)
    unit = torch.zeros_like(weight.scales)
    unit[..., 0] = 1  # scale 1, zero point 8: the product is q itself
    unit[..., 1] = 8
    values = int4_linear(eye, Quantized(4, weight.data, unit, weight.shape, weight.group))
    return values[:, :out].T.round().to(torch.int32)


def dequantize(weight: Quantized) -> torch.Tensor:
    """The float64 weight [out, in] the quantized one stands for (tests' reference)."""
    if weight.bits == 8:
        return weight.data.double() * weight.scales.double()[:, None]
    out, k = weight.shape
    q = unpack_int4(weight).double().view(out, k // weight.group, weight.group)
    scales, zeros = weight.scales.double().transpose(0, 1)[:out].unbind(-1)
    return ((q - 8) * scales[..., None] + zeros[..., None]).view(out, k)


def int4_linear(x: torch.Tensor, weight: Quantized) -> torch.Tensor:
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, weight.data, weight.group, weight.scales)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight.data, weight.group, weight.scales)


def quantized_linear(x: torch.Tensor, weight: Quantized) -> torch.Tensor:
    """x [..., in] @ weight.T in x's dtype."""
    flat = x.reshape(-1, weight.shape[1])
    if weight.bits == 8 and x.device.type == "cuda":
        y = F.linear(flat, weight.data.to(x.dtype)) * weight.scales
    elif weight.bits == 8:
        y = torch.ops.aten._weight_int8pack_mm(flat, weight.data, weight.scales)
    else:
        y = int4_linear(flat, weight)[:, : weight.shape[0]]
    return y.reshape(*x.shape[:-1], weight.shape[0])
