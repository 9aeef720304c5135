"""Matmuls on weights prepared once, at load, for the device that runs them.

Four kinds, picked per process by `choose` (TP_LLAMA_MATMUL forces one, for comparisons):

- "amx", CPUs with AMX (Sapphire Rapids and later): the tiles below, with every bfloat16 matmul
  on AMX (kernels/cpu/amx.c), in decode steps and prefill alike; the bfloat16 tiles are packed in
  AMX's layout instead of the FMA tiles' (one copy of the weights either way). Every row count on
  AMX buys a row the same bits in any batch; on the Llama 3.2 1B shape prefill runs at about
  oneDNN's speed and a decode step streams the weights faster than the FMA tiles.
- "tiles", CPUs with AVX-512 or AVX2: tp_llama's C kernels (kernels/cpu), built on first use for the
  best instruction set the CPU has (build.py's variants; AVX2 for AMD's Zen 2/3). The weight
  is repacked into column tiles that stream once per call, which beats oneDNN at decode's few
  rows in float32 and at every row count in bfloat16 (bench/kernels/matmul.py). A SwiGLU's w1 and
  w3 go in one weight whose tiles end in silu(gate) * up (`prepare_swiglu`). The same library
  runs RMSNorm, decode attention and a decode step's layers (tp_llama.backend.cpu uses them with
  this kind only). CPUs with avx512_bf16 and no AMX (AMD's Zen 4 and 5) get the `avx512-bf16`
  build, whose bfloat16 tiles multiply pairs by vdpbf16ps at every row count: one instruction a
  pair instead of widening to float32 FMAs, which keeps prefill level with oneDNN
  (bench/kernels/matmul.py).
  With AVX2 only, float32 tiles beat oneDNN at decode's few rows and trail its blocking from 32
  rows; bfloat16, which oneDNN cannot pack there, beats PyTorch's slow path at every row count
  (bench/kernels/matmul.py).
- "onednn", CPUs without the C kernels (no compiler): oneDNN's blocked layout (kernels/onednn.py).
- "plain", CUDA and anything else: F.linear.

Weights quantized at load (`bits` 8 or 4) take the C kernels' integer tiles where the kind is
"tiles" or "amx" (kernels/cpu/qtiles.py), and PyTorch's own int8/int4 matmuls elsewhere
(kernels/quant.py). Checkpoints Meta quantized (int4 QLoRA / SpinQuant, fp8) run their own formats
on PyTorch's ops (kernels/meta_int4.py, kernels/fp8.py).

A prepared weight replaces the plain one, so it costs no memory of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tp_llama.kernels import onednn
from tp_llama.kernels.cpu import ffi
from tp_llama.kernels.cpu.build import cpu_flags
from tp_llama.kernels.cpu.ops import Tiled, prepare_swiglu_tiles, prepare_tiles, tileable, tiled_linear
from tp_llama.kernels.cpu.qtiles import QuantTiled, prepare_quant_swiglu, prepare_quant_tiles, quant_linear
from tp_llama.kernels.fp8 import Fp8Weight, fp8_linear
from tp_llama.kernels.meta_int4 import Int4Weight, int4_linear
from tp_llama.kernels.quant import Quantized, quantize, quantized_linear

KINDS = ("amx", "tiles", "onednn", "plain")
C_KINDS = KINDS[:2]  # the C kernels' (kernels/cpu)
Weight = torch.Tensor | Tiled | QuantTiled | Quantized | Int4Weight | Fp8Weight

__all__ = ["C_KINDS", "KINDS", "Fp8Weight", "Int4Weight", "QuantTiled", "Quantized", "Tiled", "Weight", "choose", "cpu_flags",
           "linear", "prepare", "prepare_swiglu", "warm_up"]


def choose(device: torch.device, dtype: torch.dtype, traced: bool = False) -> tuple[str, str]:
    """(kind, why): which matmul this process's weights are prepared for, and why not a faster one.

    traced: the forward goes through torch.compile, which cannot trace oneDNN's packed weights
    ("plain" instead: inductor packs them itself); the C kernels stay, their steps untraced.
    """
    forced = os.environ.get("TP_LLAMA_MATMUL") or None  # set but empty: as if unset
    if forced is not None and forced not in KINDS:
        raise ValueError(f"TP_LLAMA_MATMUL={forced!r}: choose one of {', '.join(KINDS)}")
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or forced == "plain":
        return "plain", ""
    why = "TP_LLAMA_MATMUL=onednn" if forced == "onednn" else ""
    if forced != "onednn":
        library, why = ffi.load()
        if library is not None:
            if forced != "tiles" and ffi.amx_ready():
                return "amx", ""
            if forced != "amx":
                return "tiles", ""
            amx = "Linux lends this process no AMX tile state" if library.variant.endswith("-amx") \
                else f"the {library.variant} build has no AMX"
            return "tiles", f"TP_LLAMA_MATMUL=amx: {amx}"
    if not onednn.available(dtype):
        reason = f"oneDNN packs no {str(dtype).removeprefix('torch.')} weights on this CPU"
        return "plain", f"{why}; {reason}" if why else reason
    if traced:
        return "plain", "torch.compile cannot trace oneDNN's packed weights"
    return "onednn", why


def prepare(weight: torch.Tensor, kind: str, device: torch.device | None = None, bits: int = 16) -> Weight:
    """weight [out, in] in the form `linear` runs fastest for `kind` (see choose); bits 8 or 4:
    quantized, packed for `device` (the weight's own by default), where it will run."""
    weight = weight.detach()
    if bits != 16:
        return prepare_quant_tiles(weight, bits) if kind in C_KINDS else quantize(weight, bits, device)
    if kind in C_KINDS and tileable(weight):
        return prepare_tiles(weight, amx=kind == "amx")
    if kind in ("amx", "tiles", "onednn") and onednn.available(weight.dtype):
        return onednn.prepare(weight)
    return weight  # e.g. an odd-width bfloat16 weight on a CPU where oneDNN packs no bfloat16


def prepare_swiglu(w1: torch.Tensor, w3: torch.Tensor, kind: str, bits: int = 16) -> Tiled | QuantTiled | None:
    """w1 and w3 [ffn, in] as one gated weight whose matmul ends in SwiGLU, or None where `kind` has none."""
    if kind not in C_KINDS:
        return None
    return prepare_swiglu_tiles(w1, w3, amx=kind == "amx") if bits == 16 else prepare_quant_swiglu(w1, w3, bits)


# Each prepared form's matmul, found by the weight's type: a new format is one entry here.
MATMULS: dict[type, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    Tiled: tiled_linear, QuantTiled: quant_linear, Quantized: quantized_linear, Int4Weight: int4_linear,
    Fp8Weight: fp8_linear,
}


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [T, in] @ weight.T, whichever form the weight is in."""
    matmul = MATMULS.get(type(weight))
    if matmul is not None:
        return matmul(x, weight)
    return onednn.linear(x, weight) if weight.is_mkldnn else F.linear(x, weight)


def warm_up(weights: list[Weight], max_rows: int, dtype: torch.dtype) -> None:
    """Build any kernel the weights' form compiles per batch size now, rather than mid-serving."""
    blocked = [w for w in weights if isinstance(w, torch.Tensor) and w.is_mkldnn]
    onednn.warm_up(blocked, max_rows, dtype)
