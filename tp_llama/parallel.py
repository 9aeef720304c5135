"""Parallel plans: tensor parallel (parallelize_module) and FSDP, over one mesh of all ranks."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from tp_llama.layout import shard_dim
from tp_llama.model import Transformer, TransformerBlock


def make_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    return init_device_mesh(device.type, (world_size,))


def tp_plan(model: Transformer) -> dict[str, ParallelStyle]:
    """Module name -> style, derived from layout.shard_dim so files, loader and plan agree."""
    family = model.args.family
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        dim = shard_dim(f"{name}.weight", family)
        # torch names styles by the Linear's view: Colwise shards Linear rows but Embedding columns.
        colwise = (dim == 0) == isinstance(module, nn.Linear)
        if name in ("tok_embeddings", "output"):
            # Gather at the edges so every rank sees whole activations and whole logits.
            style = ColwiseParallel if colwise else RowwiseParallel
            plan[name] = style(input_layouts=Replicate(), output_layouts=Replicate())
        else:
            plan[name] = ColwiseParallel() if colwise else RowwiseParallel()
    return plan


def apply_tensor_parallel(model: Transformer, mesh: DeviceMesh) -> Transformer:
    return parallelize_module(model, mesh, tp_plan(model))


def apply_fsdp(model: Transformer, mesh: DeviceMesh, device: torch.device) -> FSDP:
    """FSDP1 with one unit per block; built over the mesh so it takes DTensor state dicts too."""
    return FSDP(
        model,
        device_mesh=mesh,
        auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
        device_id=device,
        param_init_fn=lambda m: m.to_empty(device=device, recurse=False),
        use_orig_params=True,
    )
