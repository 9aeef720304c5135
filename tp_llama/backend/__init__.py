"""Serving backends, applied to a built and loaded model as module swaps (gpt-fast's way).

The model (tp_llama.model) is the Llama math alone. For serving, a Preparation fuses q/k/v and
w1/w3 into one matmul each and prepares every matmul weight for the kind of matmul this process
runs fastest (tp_llama.kernels.choose), quantized where asked; with the C kernels it also swaps in
their RMSNorm, decode attention and decode-only step (backend/cpu.py). Block by block as the
checkpoint is read (`plan`, checkpoint.loader) or on a built model (`optimize`). Only for weights
this process owns: not under FSDP, and the model no longer holds Meta's separate projections afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tp_llama.backend import cpu, fused, llama4, metaquant
from tp_llama.kernels import C_KINDS, Weight, choose
from tp_llama.kernels.quant import BITS, check_groups
from tp_llama.model import Transformer
from tp_llama.model.llama4 import Llama4Block
from tp_llama.parallel.modules import LocalLinear


OUTPUT_BITS = {4: 8}  # the output layer's bits for the blocks' bits, where they differ


@dataclass(frozen=True)
class Preparation:
    """How this process prepares a model for serving: the kind of matmul (kernels.choose), why not a
    faster one, and the weights' bits (16: as read); applied block by block as a model is read
    (checkpoint.loader), or to a whole model (`optimize`)."""

    kind: str
    why: str
    bits: int
    device: torch.device

    def layer(self, block: nn.Module, name: str) -> None:
        """One block's serving modules (name: its name in the model, for errors)."""
        if metaquant.holds_meta_weights(block):  # a checkpoint Meta quantized (its loader refuses self.bits)
            metaquant.apply_layer(block, self.kind, self.device)
            return
        if self.bits != 16:
            for child, module in block.named_modules():
                if isinstance(module, (nn.Linear, LocalLinear)):
                    check_groups(f"{name}.{child}", module.weight)
        if isinstance(block, Llama4Block):
            llama4.apply_layer(block, self.kind, self.device, self.bits)
        elif self.kind in C_KINDS:
            cpu.apply_layer(block, self.kind, self.bits)
        else:
            fused.apply_layer(block, self.kind, self.device, self.bits)

    def apply(self, model: Transformer) -> None:
        """Every block, then the top: a model built whole."""
        for i, block in enumerate(model.layers):
            self.layer(block, f"layers.{i}")
        self.top(model)

    def top(self, model: Transformer) -> None:
        """The output layer and the model-wide modules, after every block. With int4 the output layer
        takes int8, as llama.cpp's 4-bit types keep theirs at 6 to 8 bits: every token's logits pass
        through it, and at 4 bits it cost the most perplexity of any layer (bench/quality/ours_ppl.py)."""
        bits = OUTPUT_BITS.get(self.bits, self.bits)
        if bits != 16:
            check_groups("output", model.output.weight)
        if self.kind in C_KINDS:
            cpu.apply_top(model, self.kind, bits)
        else:
            fused.apply_top(model, self.kind, self.device, bits)


def preparation_for(device: torch.device, dtype: torch.dtype, traced: bool = False,
                    quantized: str = "none") -> Preparation:
    """The Preparation for a model of `dtype` going to `device`. traced: decode steps will go through
    torch.compile (kernels.choose). quantized: "int8" or "int4", every matmul's weight quantized (the
    embedding stays: a step only gathers its rows), in groups that no tensor-parallel shard may split."""
    kind, why = choose(device, dtype, traced)
    return Preparation(kind, why, BITS[quantized], device)


def optimize(model: Transformer, device: torch.device | None = None, traced: bool = False,
             quantized: str = "none") -> tuple[str, str]:
    """Swap the serving modules into a built model, for the device it will run on (its own unless
    given); returns kernels.choose's (kind, why not a faster one).

    Fusing on the host and moving the fused weights afterwards leaves no fragmented copies in
    a GPU's memory.
    """
    preparation = preparation_for(device or model.norm.weight.device, model.norm.weight.dtype, traced, quantized)
    preparation.apply(model)
    return preparation.kind, preparation.why


def matmul_weights(model: Transformer) -> list[Weight]:
    """Every weight a matmul reads, in its prepared form (for kernels.warm_up)."""
    weights = [model.output.weight]
    for module in model.layers.modules():  # fused projections, Llama 4's routers and experts among them
        weights += [getattr(module, name) for name in ("wqkv", "w13", "router") if hasattr(module, name)]
        if isinstance(module, LocalLinear):
            weights.append(module.weight)
    return weights
