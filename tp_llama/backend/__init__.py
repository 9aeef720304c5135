"""Serving backends, applied to a built and loaded model as module swaps (gpt-fast's way).

The model (tp_llama.model) is the Llama math alone. For serving, `optimize` fuses q/k/v and
w1/w3 into one matmul each and prepares every matmul weight for the kind of matmul this process
runs fastest (tp_llama.kernels.choose); with the C kernels it also swaps in their RMSNorm, decode
attention and decode-only step (backend/cpu.py). Only for weights this process owns: not under
FSDP, and the model no longer holds Meta's separate projections afterwards.
"""

from __future__ import annotations

import torch

from tp_llama.backend import cpu, fused
from tp_llama.kernels import Tiled, choose
from tp_llama.model import Transformer


def optimize(model: Transformer, device: torch.device | None = None, traced: bool = False) -> tuple[str, str]:
    """Swap the serving modules in, for the device the model will run on (its own unless given);
    returns kernels.choose's (kind, why not a faster one).

    Fusing on the host and moving the fused weights afterwards leaves no fragmented copies in
    a GPU's memory. traced: decode steps will go through torch.compile (kernels.choose).
    """
    kind, why = choose(device or model.norm.weight.device, model.norm.weight.dtype, traced)
    if kind in ("amx", "tiles"):
        cpu.apply(model, kind)
    else:
        fused.apply(model, kind)
    return kind, why


def matmul_weights(model: Transformer) -> list[torch.Tensor | Tiled]:
    """Every weight a matmul reads, in its prepared form (for kernels.warm_up)."""
    weights = [model.output.weight]
    for layer in model.layers:
        attention, ffn = layer.attention, layer.feed_forward
        weights += [attention.wqkv, attention.wo.weight, ffn.w13, ffn.w2.weight]
    return weights
