"""Serving backends, applied to a built and loaded model as module swaps (gpt-fast's way).

The model (tp_llama.model) is the Llama math alone. For serving, `optimize` fuses q/k/v and
w1/w3 into one matmul each and prepares every matmul weight for the kind of matmul this process
runs fastest (tp_llama.kernels.choose); with the C kernels it also swaps in their RMSNorm, decode
attention and decode-only step (backend/cpu.py). Only for weights this process owns: not under
FSDP, and the model no longer holds Meta's separate projections afterwards.
"""

from __future__ import annotations

import torch
from torch import nn

from tp_llama.backend import cpu, fused
from tp_llama.kernels import Weight, choose
from tp_llama.kernels.quant import BITS, check_groups
from tp_llama.model import Transformer
from tp_llama.parallel.modules import LocalLinear


def optimize(model: Transformer, device: torch.device | None = None, traced: bool = False,
             quantized: str = "none") -> tuple[str, str]:
    """Swap the serving modules in, for the device the model will run on (its own unless given);
    returns kernels.choose's (kind, why not a faster one).

    Fusing on the host and moving the fused weights afterwards leaves no fragmented copies in
    a GPU's memory. traced: decode steps will go through torch.compile (kernels.choose).
    quantized: "int8" or "int4", every matmul's weight quantized (the embedding stays: a step only
    gathers its rows), in groups that no slice of a tensor-parallel shard may split.
    """
    device = device or model.norm.weight.device
    kind, why = choose(device, model.norm.weight.dtype, traced)
    bits = BITS[quantized]
    if bits != 16:
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, LocalLinear)):
                check_groups(name, module.weight)
    if kind in ("amx", "tiles"):
        cpu.apply(model, kind, bits)
    else:
        fused.apply(model, kind, device, bits)
    return kind, why


def matmul_weights(model: Transformer) -> list[Weight]:
    """Every weight a matmul reads, in its prepared form (for kernels.warm_up)."""
    weights = [model.output.weight]
    for layer in model.layers:
        attention, ffn = layer.attention, layer.feed_forward
        weights += [attention.wqkv, attention.wo.weight, ffn.w13, ffn.w2.weight]
    return weights
