"""The matmuls of Meta's int4 checkpoints (Llama 3.2 1B/3B QLoRA and SpinQuant: torchao's 8da4w,
`Int8DynActInt4WeightLinear`), on PyTorch's ops (every device) and the C kernels' int4 tiles.

Each weight holds int4 values (-8..7, one per int8) in groups of `group` along k with a float32 scale (and
zero point) a group, w = (q - zero) * scale. Each matmul first quantizes its input per token to int8,
asymmetric, over the whole row (the scale and zero point from the row's minimum and maximum, both widened
to include zero), then multiplies the dequantized input by the dequantized weight in float32. QLoRA adds
its adaptor on the unquantized input, x @ A^T @ B^T * lora_scale; SpinQuant's w2 takes a Walsh-Hadamard
transform of its input first (ExecuTorch's online rotation).

A row-parallel weight under tensor parallelism holds only its slice of k, but a token's range (and the
Hadamard transform) spans the whole row: `Across` brings in the other ranks' parts.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from tp_llama.kernels.cpu.ffi import library
from tp_llama.kernels.cpu.qtiles import QuantTiled, group_size, pack_pairs
from tp_llama.kernels.cpu.qtiles import pack as pack_quant
from tp_llama.kernels.quant import INT4_ROWS, pack_int4

ACT_MIN, ACT_MAX = -128, 127  # the int8 range of a token's quantized activations
ACT_EPS = torch.finfo(torch.float32).eps  # the smallest activation step (torchao's eps)
TINYGEMM_GROUPS = (32, 64, 128, 256)  # the group sizes PyTorch's int4 matmuls take


class Across(Protocol):
    """What a row-parallel weight's input needs from the other ranks (tp_llama.checkpoint gives it)."""

    rank: int
    size: int

    def row_range(self, bounds: torch.Tensor) -> torch.Tensor:
        """bounds [T, 2] of (max, -min) over this rank's part of each row: the whole row's, in place."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, k] on every rank: [size, T, k], the ranks' parts in rank order."""
        ...


@dataclass
class Int4Weight:
    """A weight [out, k] as torchao's 8da4w holds it. `q` (int8, -8..7), `scales` and `zeros` ([out,
    k / group], float32) until `pack` lays them out for the device's int4 matmul; `lora_a` [rank, k] and
    `lora_b` [out, rank] (float32) QLoRA's adaptor; `hadamard`: the input is rotated first."""

    shape: tuple[int, int]
    group: int
    q: torch.Tensor | None
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    lora_scale: float = 1.0
    hadamard: bool = False
    across: Across | None = None
    lora_parts: tuple[int, ...] = ()  # fused weights' output widths, their adaptors' B block-diagonal (fuse_int4)
    packed: torch.Tensor | None = field(default=None, repr=False)
    scales_zeros: torch.Tensor | None = field(default=None, repr=False)
    dense: torch.Tensor | None = field(default=None, repr=False)  # group sizes the int4 matmuls lack
    tiles: QuantTiled | None = field(default=None, repr=False)  # the C kernels' int4 tiles (pack_tiles)
    row_sums: torch.Tensor | None = field(default=None, repr=False)  # [out] float32: the tiles' weight summed along k
    c: ctypes.Structure | None = field(default=None, repr=False)  # the tiles' struct MetaInt4 (kernels/cpu/api.h)
    lora_ends: torch.Tensor | None = field(default=None, repr=False)  # int64: where each part's outputs end (c's)

    def dequantize(self) -> torch.Tensor:
        """The float64 weight [out, k] (before packing)."""
        out, k = self.shape
        q = self.q.double().view(out, k // self.group, self.group)
        zeros = self.zeros.double() if self.zeros is not None else 0.0
        return ((q - zeros[..., None] if self.zeros is not None else q) * self.scales.double()[..., None]).view(out, k)


def check_int4(name: str, weight: Int4Weight) -> None:
    """Shapes and values a matmul relies on; ValueError naming the tensor otherwise."""
    out, k = weight.shape
    groups = (out, k // weight.group)
    if k % weight.group:
        raise ValueError(f"{name}: groups of {weight.group} do not divide k = {k}")
    if weight.q is None or weight.q.dtype != torch.int8 or tuple(weight.q.shape) != (out, k):
        raise ValueError(f"{name}: int4 values must be int8 [{out}, {k}]")
    if int(weight.q.min()) < -8 or int(weight.q.max()) > 7:
        raise ValueError(f"{name}: int4 values must lie in -8..7, found {int(weight.q.min())}..{int(weight.q.max())}")
    for part, tensor in (("scales", weight.scales), ("zeros", weight.zeros)):
        if tensor is not None and tuple(tensor.shape) != groups:
            raise ValueError(f"{name}.{part}: shape {tuple(tensor.shape)}, expected {groups} "
                             f"(groups of {weight.group})")


def fuse_int4(weights: list[Int4Weight]) -> Int4Weight:
    """One weight whose outputs are the weights' outputs side by side (q/k/v, w1/w3): the same input
    quantization (one input row), the adaptors' A stacked and their B block-diagonal."""
    first = weights[0]
    if len({(w.shape[1], w.group, w.lora_scale, w.hadamard, w.lora_a is None) for w in weights}) != 1:
        raise ValueError("only weights of one k, group, adaptor scale and rotation fuse")
    zeros = None
    if any(w.zeros is not None for w in weights):
        zeros = torch.cat([w.zeros if w.zeros is not None else torch.zeros_like(w.scales) for w in weights])
    lora_a = lora_b = None
    if first.lora_a is not None:
        lora_a = torch.cat([w.lora_a for w in weights])
        lora_b = torch.block_diag(*[w.lora_b for w in weights])
    out = sum(w.shape[0] for w in weights)
    return replace(first, shape=(out, first.shape[1]), q=torch.cat([w.q for w in weights]),
                   scales=torch.cat([w.scales for w in weights]), zeros=zeros, lora_a=lora_a, lora_b=lora_b,
                   lora_parts=tuple(w.shape[0] for w in weights) if lora_a is not None else (),
                   packed=None, scales_zeros=None, dense=None)


def pack(weight: Int4Weight, device: torch.device | None = None, bf16: bool = False) -> Int4Weight:
    """The weight laid out for the int4 matmul on `device` (PyTorch's tinygemm packing, whose 4-bit values
    are q + 8 and whose zero point stands at 8: w = (q + 8 - 8) * scale + zero', zero' = -zero * scale); a
    group size those matmuls lack keeps a dequantized float32 weight. The int8 values are dropped.

    bf16 (CPU): for bfloat16 inputs, whose int4 matmul is PyTorch's vectorized one (its float32 one is
    not): each float32 scale and zero' as a bfloat16 pair (high part, remainder) [2, k / group, out, 2],
    two matmuls summed, so the scales keep about 16 bits of their 24."""
    device = device or weight.scales.device
    if weight.packed is not None or weight.dense is not None or weight.tiles is not None:
        return weight
    out, k = weight.shape
    lora = {name: None if getattr(weight, name) is None else getattr(weight, name).to(device)
            for name in ("lora_a", "lora_b")}
    if weight.group not in TINYGEMM_GROUPS:
        dense = weight.dequantize().float().to(device)
        return replace(weight, q=None, zeros=None, dense=dense, **lora)
    rows = out + (-out % INT4_ROWS)
    q = F.pad(weight.q.to(torch.int32) + 8, (0, 0, 0, rows - out))
    scales = F.pad(weight.scales.float(), (0, 0, 0, rows - out))
    zeros = -F.pad(weight.zeros.float(), (0, 0, 0, rows - out)) * scales if weight.zeros is not None \
        else torch.zeros_like(scales)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CUDA's tinygemm takes bfloat16 only
    scales_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    if bf16 and device.type == "cpu":
        high = scales_zeros.bfloat16()
        scales_zeros = torch.stack([high, (scales_zeros - high.float()).bfloat16()])
    scales_zeros = scales_zeros.to(device, scales_zeros.dtype if scales_zeros.dim() == 4 else dtype)
    return replace(weight, q=None, zeros=None, packed=pack_int4(q, device), scales_zeros=scales_zeros,
                   scales=weight.scales.to(device), **lora)


def fits_tiles(weight: Int4Weight) -> bool:
    """Whether the C kernels' int4 tiles hold the weight's groups (pack_tiles)."""
    return weight.group % group_size() == 0


def pack_tiles(weight: Int4Weight) -> Int4Weight:
    """The weight in the C kernels' int4 tiles (kernels/cpu/quant.c: groups of QBLOCK = 32 along k, w = scale *
    u + min with u = q + 8 in 0..15, scale and min in fp16), a group of 256 as 8 of 32 with its scale and
    min; exact but for the fp16 rounding of the scales and mins (ExecuTorch's XNNPACK kernels round Meta's
    scales to bfloat16). Its matmul (tiles_matmul) quantizes each input row in C and multiplies its int8
    values; each row's zero point comes off afterwards, times the weight's sum along k. A group the tiles
    cannot hold is refused (`fits_tiles`). The adaptor goes into the same C call, in bfloat16 as Meta
    ships it (its float32 copy in PyTorch's matmuls cost more than its bytes: docs/perf-log/2026-11-27.md),
    B transposed and, after fusion, only its diagonal blocks (`_adaptor_blocks`)."""
    block = group_size()
    out, k = weight.shape
    if weight.q is None or not fits_tiles(weight):
        raise ValueError(f"int4 tiles take unpacked weights in groups of a multiple of {block}, not {weight.group}")
    repeat = weight.group // block
    scales = weight.scales.float().repeat_interleave(repeat, dim=1)
    zeros = weight.zeros.float().repeat_interleave(repeat, dim=1) if weight.zeros is not None else 0.0
    scales16 = scales.half()
    mins16 = (-scales16.float() * (8 + zeros)).half()  # from the rounded scale: exact where zero is 0 (-8 s)
    u = (weight.q.to(torch.int16) + 8).to(torch.int8)
    sums = (u.view(out, k // block, block).double().sum(-1) * scales16.double() + block * mins16.double()).sum(-1)
    lora = {}
    if weight.lora_a is not None:
        parts, b = _adaptor_blocks(weight)
        lora = {"lora_a": weight.lora_a.bfloat16().contiguous(), "lora_b": b.bfloat16().T.contiguous().T,
                "lora_parts": parts, "lora_ends": torch.tensor(parts).cumsum(0)}
    packed = replace(weight, q=None, zeros=None, tiles=pack_quant((u, scales16, mins16), 4), row_sums=sums.float(),
                     **lora)
    adaptor = (None, None, None, 0, 1)
    if lora:
        adaptor = (packed.lora_a.data_ptr(), packed.lora_b.T.data_ptr(), packed.lora_ends.data_ptr(),
                   packed.lora_a.shape[0], len(packed.lora_parts))
    packed.c = library().structs["MetaInt4"](packed.tiles.data.data_ptr(), packed.row_sums.data_ptr(), *adaptor,
                                             packed.lora_scale, packed.hadamard)
    return packed


def _adaptor_blocks(weight: Int4Weight) -> tuple[tuple[int, ...], torch.Tensor]:
    """(the parts' output widths, B's diagonal blocks side by side [out, rank / parts]): fused weights' B
    without its zeros, where every part's width is a multiple of the C adaptor's 16 columns; else one part."""
    out, rank = weight.lora_b.shape
    parts = weight.lora_parts or (out,)
    if rank % len(parts) or any(width % 16 for width in parts):
        return (out,), weight.lora_b
    r = rank // len(parts)
    return parts, torch.cat([b[:, i * r : (i + 1) * r] for i, b in enumerate(weight.lora_b.split(list(parts)))])


def quantize_steps(x: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q - zero [T, k], scale [T, 1]): x [T, k] (float32) quantized to int8 per row as torchao's per-token
    asymmetric quantization does, bounds [T, 2] holding each row's (max, -min) over the whole row. The
    steps are integers in -255..255, exact in bfloat16."""
    high = bounds[:, :1].clamp(min=0)
    low = (-bounds[:, 1:]).clamp(max=0)
    scale = ((high - low) / float(ACT_MAX - ACT_MIN)).clamp(min=ACT_EPS)
    zero = (ACT_MIN - torch.round(low / scale)).clamp(ACT_MIN, ACT_MAX)
    q = (torch.round(x * (1.0 / scale)) + zero).clamp(ACT_MIN, ACT_MAX)
    return q - zero, scale


def quantize_rows(x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """x [T, k] (float32) quantized to int8 per row and dequantized (quantize_steps times the scale)."""
    steps, scale = quantize_steps(x, bounds)
    return steps * scale


def row_bounds(x: torch.Tensor) -> torch.Tensor:
    """[T, 2]: each row's (max, -min)."""
    return torch.stack([x.amax(dim=-1), -x.amin(dim=-1)], dim=-1)


def walsh_hadamard(x: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """x [..., n] times the Sylvester Hadamard matrix of n (a power of two), over sqrt(n) if normalized:
    log2(n) butterfly passes of (a + b, a - b)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"a Walsh-Hadamard transform needs a power of two, not {n}")
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    half = 1
    while half < n:
        pairs = y.view(-1, n // (2 * half), 2, half)
        y = torch.stack([pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]], dim=2).view(-1, n)
        half *= 2
    y = y.view(*lead, n)
    return y / math.sqrt(n) if normalize else y


def hadamard_in_c(x: torch.Tensor) -> torch.Tensor:
    """walsh_hadamard of x [T, n] (float32, CPU) in the C kernels: bit for bit, without PyTorch's op per pass."""
    if x.shape[-1] & (x.shape[-1] - 1):
        raise ValueError(f"a Walsh-Hadamard transform needs a power of two, not {x.shape[-1]}")
    y = x.contiguous().clone()
    library().hadamard_rows(y.data_ptr(), y.shape[0], y.shape[1])
    return y


def rotate(x: torch.Tensor, across: Across | None, in_c: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's part of H x / sqrt(n), each whole row's bounds) for x [T, k] this rank's part of
    each row. The whole row's Hadamard matrix is H_size (x) H_k: each rank transforms its own part,
    the parts are gathered, and a butterfly over the ranks finishes every rank's part (all of them, so
    every rank knows each row's range without another collective). in_c: one rank's transform in the C
    kernels (the same float32 operations in the same order)."""
    if across is None or across.size == 1:
        y = hadamard_in_c(x) if in_c else walsh_hadamard(x)
        return y, row_bounds(y)
    parts = across.gather(walsh_hadamard(x, normalize=False))  # [size, T, k]
    size, rows, k = parts.shape
    whole = walsh_hadamard(parts.permute(1, 2, 0), normalize=False).permute(0, 2, 1)  # [T, size, k]
    whole = whole / math.sqrt(size * k)
    return whole[:, across.rank].contiguous(), row_bounds(whole.reshape(rows, size * k))


def int4_matmul(steps: torch.Tensor, scale: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """(steps * scale) [T, k] @ the weight^T in float32: the quantized input as its integer steps and each
    row's scale (bfloat16 inputs on CUDA, whose int4 matmul takes no other)."""
    if weight.dense is not None:
        return (steps * scale) @ weight.dense.T
    if weight.scales_zeros.dim() == 4:  # the bfloat16 pairs: exact steps, two matmuls
        exact = steps.bfloat16()
        y = sum(torch.ops.aten._weight_int4pack_mm_for_cpu(exact, weight.packed, weight.group, part).float()
                for part in weight.scales_zeros)
        return y[:, : weight.shape[0]] * scale
    xq = steps * scale
    if xq.device.type == "cuda":
        y = torch.ops.aten._weight_int4pack_mm(xq.bfloat16(), weight.packed, weight.group, weight.scales_zeros)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xq, weight.packed, weight.group, weight.scales_zeros)
    return y[:, : weight.shape[0]].float()


def int4_linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [..., k] @ weight^T (plus the adaptor), in x's dtype, computed in float32."""
    if weight.packed is None and weight.dense is None and weight.tiles is None:
        packed = pack(weight, x.device, x.dtype == torch.bfloat16)
        weight.__dict__.update(packed.__dict__)  # packed once, in place: the module keeps this object
    out, k = weight.shape
    flat = x.reshape(-1, k)
    if weight.tiles is None:  # PyTorch's path computes in float32 throughout; the tiles take bfloat16 rows too
        flat = flat.float()
    bounds = None
    if weight.hadamard:
        flat, bounds = rotate(flat.float(), weight.across, in_c=weight.tiles is not None)
    elif weight.across is not None and weight.across.size > 1:
        bounds = weight.across.row_range(row_bounds(flat.float()))
    if weight.tiles is not None:  # the adaptor too
        return tiles_matmul(flat, bounds, weight).to(x.dtype).reshape(*x.shape[:-1], out)
    y = int4_matmul(*quantize_steps(flat, row_bounds(flat) if bounds is None else bounds), weight)
    if weight.lora_a is not None:  # in place, one op for the second matmul, the scale and the sum
        y = y.addmm_(flat @ weight.lora_a.T, weight.lora_b.T, alpha=weight.lora_scale)
    return y.to(x.dtype).reshape(*x.shape[:-1], out)


def tiles_matmul(x: torch.Tensor, bounds: torch.Tensor | None, weight: Int4Weight) -> torch.Tensor:
    """x [T, k] (float32 or bfloat16) @ the weight^T in float32 on the C kernels' int4 tiles, each row
    quantized in C as quantize_steps does, over `bounds` (None: its own range); plus the adaptor on x."""
    rows, k = x.shape
    x = x.contiguous() if x.dtype in (torch.float32, torch.bfloat16) else x.float().contiguous()
    if bounds is not None:
        bounds = bounds.float().contiguous()
    y = torch.empty((rows, weight.shape[0]), dtype=torch.float32)
    if rows and library().meta_int4_linear(x.data_ptr(), 0 if bounds is None else bounds.data_ptr(), rows, k,
                                           ctypes.byref(weight.c), weight.shape[0], y.data_ptr(),
                                           x.dtype == torch.bfloat16):
        raise MemoryError(f"no memory to quantize {rows} x {k} inputs")
    return y


def int8_tiles(q: torch.Tensor, scales: torch.Tensor) -> QuantTiled | None:
    """Meta's int8 output layer, q [out, k] with scales [out] or [out, n] (n groups along each row), in the C
    kernels' pair tiles: int8 times an fp16 scale a block, the inputs quantized to int16 per block of QBLOCK
    in each matmul. Meta's loader multiplies the int8 values by their scales into the model's dtype and
    runs them on float inputs: in a bfloat16 model the rounding of each weight there errs more than the
    fp16 scales and 16-bit inputs here, and the tiles stream half the bytes (a float32 model's logits
    move by about 2^-15 of their scale). None where a group is no whole number of blocks, or a scale lies
    outside fp16's normal range."""
    out, k = q.shape
    scales = scales.reshape(out, -1).float()
    if k % scales.shape[1] or (k // scales.shape[1]) % group_size():
        return None
    fp16 = torch.finfo(torch.float16)
    if not bool(((scales.abs() >= fp16.tiny) & (scales.abs() <= fp16.max)).all()):
        return None
    blocks = scales.repeat_interleave(k // scales.shape[1] // group_size(), dim=1)
    return pack_pairs(q.contiguous(), blocks.half())


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 q [rows, cols] times scales [rows, n] (n groups along each row, n = 1: a scale a row), as
    Meta's reference loader makes the embedding and output layer: float32 products, then `dtype`."""
    rows, cols = q.shape
    scales = scales.reshape(rows, -1).float()
    groups = scales.shape[1]
    return (q.float().view(rows, groups, cols // groups) * scales[..., None]).view(rows, cols).to(dtype)
