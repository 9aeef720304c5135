"""LoRA adapters resident on a rank: read, cut to its shards, written into fixed slots, and hooked into its
serving modules, whose matmuls then add each row's adapter delta (lora/slots.py).

Slots hold at most handler.max_loras adapters; rank 0 decides which adapter sits in which slot (the yaml's
first, then any the requests name, the least recently used leaving for another), and every rank writes the
same slot in the same step (engine/core.py's control step), so slots never differ across ranks.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from tp_llama.backend.cpu import CFeedForward, DecodeLayers, GatedFeedForward
from tp_llama.backend.fused import FusedAttention, FusedFeedForward
from tp_llama.config import EngineConfig
from tp_llama.kernels.cpu import ops
from tp_llama.kernels.cpu.ffi import library
from tp_llama.lora.adapters import Adapter, AdapterError, read_adapter
from tp_llama.lora.slots import AdapterRef, LoraStep, Projection, SlotWeights, allocate_slots, write_slot
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


class ResidentAdapters:
    """This rank's adapter slots, hooked into its model; on rank 0 also which adapter sits where (`refs`, by
    name, what the scheduler reads) and when each was last asked for."""

    def __init__(self, config: EngineConfig, model: nn.Module, args: ModelArgs, info: DistInfo, dtype: torch.dtype):
        self.config, self.model, self.args, self.info = config, model, args, info
        blocks, self.gated_run = adapted_layers(model)
        # Every yaml adapter is read now, so a bad one fails the load; the first max_loras stay resident.
        first = [self._read(name, entry) for name, entry in (config.lora_adapters or {}).items()][: config.max_loras]
        # Where adapters may arrive later, max_loras slots on every projection; otherwise the yaml's adapters' own.
        later = config.lora_runtime_loading or len(config.lora_adapters or {}) > config.max_loras
        slots = (config.max_loras if later else len(first)) + 1
        self.layers = allocate_slots(first, args, config.max_lora_rank, info.world_size, slots, later, dtype,
                                     self.gated_run)
        self.step = LoraStep()
        for block, projections in zip(blocks, self.layers):
            hooks = {"qkv": (block.attention, "lora_qkv"), "wo": (block.attention.wo, "lora"),
                     "w13": (block.feed_forward, "lora_w13"), "w2": (block.feed_forward.w2, "lora")}
            for name in list(projections):
                projections[name] = self._resident(projections[name])
                module, attribute = hooks[name]
                setattr(module, attribute, Projection(projections[name], self.step))
        if isinstance(model.layers, DecodeLayers):
            model.layers.forget_plan()  # its C layers point at the adapters' slots from the next step on
        self.names: list[str | None] = [None] * slots  # slot -> adapter (slot 0: the base)
        self.refs: dict[str, AdapterRef] = {}
        self.used: dict[str, float] = {}
        for slot, adapter in enumerate(first, start=1):
            self._write(slot, adapter)

    def _read(self, name: str, entry: object) -> Adapter:
        adapter = read_adapter(name, entry, self.args, self.config.max_lora_rank)
        log(f"LoRA adapter {name!r}: rank {adapter.rank}, {len(adapter.weights)} modules from "
            f"{Path(adapter.source).parent}", self.info.rank)
        return adapter

    def _resident(self, weights: SlotWeights) -> SlotWeights:
        """Slots on the model's device, with the C kernels' view of them where the C layers run."""
        weights = SlotWeights(weights.a.to(self.info.device), weights.bt.to(self.info.device), weights.lines)
        if self.gated_run is not None:
            weights.c = ops.lora_weights(weights.a, weights.bt, *weights.lines)
        return weights

    def _write(self, slot: int, adapter: Adapter | None) -> None:
        write_slot(self.layers, slot, adapter, self.args, self.config.max_lora_rank, self.info.rank,
                   self.info.world_size, self.gated_run)
        for projections in self.layers:
            for weights in projections.values():
                if weights.c is not None:
                    ops.lora_retile(weights.c, slot)
        old = self.names[slot]
        if old is not None:
            self.refs.pop(old, None)
        self.names[slot] = None if adapter is None else adapter.name
        if adapter is not None:
            self.refs[adapter.name] = AdapterRef(adapter.name, slot, adapter.digest)
            self.used[adapter.name] = time.monotonic()

    def load(self, slot: int, name: str, entry: object) -> None:
        """Every rank, in the same step: `name`'s files (`entry`, as the yaml's) into `slot`. Any error leaves
        the slot empty and is raised."""
        try:
            self._write(slot, self._read(name, entry))
        except Exception:
            self.load_empty(slot)
            raise

    def retire(self, name: str) -> None:
        """Rank 0: an adapter no new request may name: its slot is the first taken once no sequence runs on it,
        and a later load of the name reads its files again."""
        if name in self.used:
            self.used[name] = float("-inf")

    def retired(self, name: str) -> bool:
        """Rank 0: whether `name`'s slot holds the weights of an adapter since unloaded (retire)."""
        return name in self.refs and self.used.get(name) == float("-inf")

    def load_empty(self, slot: int) -> None:
        """The slot emptied (a load some rank failed)."""
        self._write(slot, None)

    def pick_slot(self, name: str, busy: set[str]) -> int | None:
        """Rank 0: where `name` goes: its own slot, a free one, or the least recently used adapter's that no
        sequence in `busy` runs on; None where every slot is busy."""
        if self.retired(name):  # read again into its own slot: one name never holds two slots
            return None if name in busy else self.refs[name].slot
        if name in self.refs:
            self.used[name] = time.monotonic()
            return self.refs[name].slot
        free = [slot for slot in range(1, len(self.names)) if self.names[slot] is None]
        if free:
            return free[0]
        idle = [n for n in self.refs if n not in busy]
        return self.refs[min(idle, key=lambda n: self.used[n])].slot if idle else None


def resident_adapters(config: EngineConfig, model: nn.Module, args: ModelArgs, info: DistInfo,
                      dtype: torch.dtype) -> ResidentAdapters | None:
    """The adapters' slots on this rank in the model's `dtype`, None where no adapter can ever be served."""
    if not config.lora_adapters and not config.lora_runtime_loading:
        return None
    if args.family == "llama4":  # its MoE layers have no w1/w3/w2 of their own to adapt
        raise AdapterError("LoRA adapters on Llama 4 are not served: remove handler.lora_adapters and "
                           "handler.lora_runtime_loading")
    return ResidentAdapters(config, model, args, info, dtype)

