"""The GPU check's rows for the matmuls of Meta's quantized downloads (`python -m bench.gpu_check --quantized`).

- int4 (QLoRA and SpinQuant layers: groups of 32 with zero points and an adaptor, groups of 256 with a
  Walsh-Hadamard rotation): the device's int4 matmul (CUDA's tinygemm takes bfloat16 inputs) against
  the same layer on the CPU in float32, the path tests/test_meta_quantized.py holds to torchao's;
- fp8 (405B's rows): torch._scaled_mm, each input row quantized to float8, against the float64
  product with the dequantized weight; only where the GPU has float8 matmuls.

`fp8_feed_forward` gives a built model Meta's 405B FP8 layout (bench/gpu_profile.py --fp8 times it).
"""

from __future__ import annotations

from typing import Callable

import torch

from tp_llama.checkpoint.quantized import quantized_module
from tp_llama.kernels.fp8 import FP8_MAX, Fp8Weight, fp8_linear, fp8_matmuls
from tp_llama.kernels.meta_int4 import Int4Weight, int4_linear
from tp_llama.model import Transformer
from tp_llama.parallel.layout import NONE

Record = Callable[[str, str, str, bool], bool]


def int4_layer(out: int, k: int, group: int, seed: int, lora: bool, hadamard: bool) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (out, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(out, k // group, generator=gen) * 0.02 + 0.005
    zeros = torch.randint(-2, 3, (out, k // group), generator=gen).float() if lora else None
    lora_a = torch.randn(4, k, generator=gen) * k**-0.5 if lora else None
    lora_b = torch.randn(out, 4, generator=gen) * 0.05 if lora else None
    return Int4Weight((out, k), group, q, scales, zeros, lora_a, lora_b, 2.0 if lora else 1.0, hadamard)


def rows(device: str, record: Record) -> None:
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(1))
    for name, group, lora, hadamard in (("QLoRA group 32", 32, True, False), ("SpinQuant group 256", 256, False, True)):
        want = int4_linear(x, int4_layer(512, 1024, group, 2, lora, hadamard)).double()
        got = int4_linear(x.to(device, torch.bfloat16), int4_layer(512, 1024, group, 2, lora, hadamard))
        share = (got.double().cpu() - want).abs().max().item() / want.abs().max().item()
        record("Meta int4 matmul", f"{device} {name}, 5 rows", f"max abs diff {share:.1%} of the output scale from "
               "the CPU's float32 (limit 2%)", share < 0.02)
    if not fp8_matmuls(torch.device(device)):
        return
    data, scales = fp8_rows(torch.randn(512, 1024, generator=torch.Generator().manual_seed(3)) * 0.02)
    want = x.double() @ (data.double() * scales.double().T).T
    layer = Fp8Weight((512, 1024), [data.to(device)], [scales.to(device)])
    got = fp8_linear(x.to(device, torch.bfloat16), layer).double().cpu()
    share = (got - want).abs().max().item() / want.abs().max().item()
    record("Meta fp8 matmul", f"{device} torch._scaled_mm, 5 rows", f"max abs diff {share:.1%} of the output scale "
           "from float64 (limit 5%)", share < 0.05)


def fp8_feed_forward(model: Transformer) -> int:
    """The feed-forward weights of every layer but the first and the last as float8 e4m3 with a scale a row,
    as Meta's 405B FP8 files hold them (one process: one k slice); returns the bytes that saves."""
    saved = 0
    for layer in list(model.layers)[1:-1]:
        ffn = layer.feed_forward
        for name in ("w1", "w2", "w3"):
            weight = getattr(ffn, name).weight.detach()
            data, scales = fp8_rows(weight)
            setattr(ffn, name, quantized_module(Fp8Weight(tuple(weight.shape), [data], [scales]), NONE, None))
            saved += weight.numel() * (weight.element_size() - 1)
    return saved


def fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 values [out, k], float32 scales [1, out]): a scale a row, its largest magnitude at FP8_MAX."""
    w = weight.float()
    scales = w.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return (w / scales).to(torch.float8_e4m3fn), scales.view(1, -1)
