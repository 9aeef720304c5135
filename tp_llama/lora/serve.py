"""The yaml's LoRA adapters made resident on a rank: read, cut to its shards, put in slots, and hooked
into its serving modules, whose matmuls then add each row's adapter delta (lora/slots.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tp_llama.backend.cpu import CFeedForward, DecodeLayers, GatedFeedForward
from tp_llama.backend.fused import FusedAttention, FusedFeedForward
from tp_llama.config import EngineConfig
from tp_llama.kernels.cpu import ops
from tp_llama.kernels.cpu.ffi import library
from tp_llama.lora.adapters import read_adapter
from tp_llama.lora.slots import AdapterRef, LoraStep, Projection, SlotWeights, build_slots
from tp_llama.model.args import ModelArgs
from tp_llama.parallel.distributed import DistInfo, log


def adapted_layers(model: nn.Module) -> tuple[list[nn.Module], int | None]:
    """The model's blocks, each with serving modules an adapter can hook, and the gated tiles' run where
    the FFN's w1/w3 matmul ends in SwiGLU (None: it does not); ValueError for a model they cannot run on."""
    blocks = list(model.layers)
    for block in blocks:
        if (not isinstance(block.attention, FusedAttention) or isinstance(block.feed_forward, CFeedForward)
                or not isinstance(block.feed_forward, (FusedFeedForward, GatedFeedForward))):
            raise ValueError("LoRA adapters run on a served model's own projections (mode 'tp'), not on a checkpoint "
                             "Meta quantized (its QLoRA adaptor is already in its weights)")
    gated = isinstance(blocks[0].feed_forward, GatedFeedForward)
    return blocks, library().constants["GATE_RUN"] if gated else None


def load_adapters(config: EngineConfig, model: nn.Module, args: ModelArgs,
                  info: DistInfo) -> tuple[LoraStep | None, dict[str, AdapterRef]]:
    """The yaml's adapters (handler.lora_adapters) resident in `model` on this rank: the step their
    projections read each forward's slots from, and each adapter by name. (None, {}) without adapters."""
    if not config.lora_adapters:
        return None, {}
    blocks, gated_run = adapted_layers(model)
    adapters = []
    for name, entry in config.lora_adapters.items():
        adapter = read_adapter(name, entry, args, config.max_lora_rank)
        log(f"LoRA adapter {name!r}: rank {adapter.rank}, {len(adapter.weights)} modules from "
            f"{Path(adapter.source).parent}", info.rank)
        adapters.append(adapter)
    layers = build_slots(adapters, args, config.max_lora_rank, info.rank, info.world_size, gated_run)
    step = LoraStep()
    for block, projections in zip(blocks, layers):
        hooks = {"qkv": (block.attention, "lora_qkv"), "wo": (block.attention.wo, "lora"),
                 "w13": (block.feed_forward, "lora_w13"), "w2": (block.feed_forward.w2, "lora")}
        for name, weights in projections.items():
            module, attribute = hooks[name]
            setattr(module, attribute, Projection(resident(weights, info.device, gated_run is not None), step))
    if isinstance(model.layers, DecodeLayers):
        model.layers.forget_plan()  # its C layers point at the adapters from the next step on
    return step, {a.name: AdapterRef(a.name, slot, a.digest) for slot, a in enumerate(adapters, start=1)}


def resident(weights: SlotWeights, device: torch.device, c_layers: bool) -> SlotWeights:
    """Slots on the model's device, with the C kernels' view of them where the C layers run."""
    weights = SlotWeights(weights.a.to(device), weights.bt.to(device))
    if c_layers:
        weights.c = ops.lora_weights(weights.a, weights.bt)
    return weights
