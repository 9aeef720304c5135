"""The DTensor oracle of the `tp` mode: torch's own tensor parallelism on the same sharding table.

Tests build the model with parallelize_module from `tp_plan` (layout.TP_TABLE read as DTensor
styles) and compare it with the local modules the loader builds; `localize` turns a DTensor
model into local modules, which must give the same logits.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from tp_llama.model import Transformer
from tp_llama.parallel.layout import ALL_GATHER, GATHER, tp_sharding
from tp_llama.parallel.modules import local_module

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


def tp_plan(model: Transformer) -> dict[str, ParallelStyle]:
    """Module name -> DTensor style, from layout.TP_TABLE (the test oracle of the local modules)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    family = model.args.family
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        rule = tp_sharding(name, family)
        # torch names styles by the Linear's view: Colwise shards Linear rows but Embedding columns.
        colwise = (rule.dim == 0) == isinstance(module, nn.Linear)
        style = ColwiseParallel if colwise else RowwiseParallel
        if rule.comm in (ALL_GATHER, GATHER) or isinstance(module, nn.Embedding):
            # Gather at the edges so every rank sees whole activations and whole logits.
            plan[name] = style(input_layouts=Replicate(), output_layouts=Replicate())
        else:
            plan[name] = style()
    return plan


def apply_tensor_parallel(model: Transformer, mesh: DeviceMesh) -> Transformer:
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, tp_plan(model))


@torch.no_grad()
def localize(model: Transformer, group: dist.ProcessGroup | None = None) -> Transformer:
    """Replace DTensor-sharded Linears and Embedding by local modules (local_module); a test oracle.

    load_tp_model builds the local modules itself; a model without DTensor parameters (what it
    returns) is left as it is. The new modules keep the parameter names, so state_dict still uses
    Meta's names (local shards). Swapping a module drops parallelize_module's hooks with it.
    """
    if "torch.distributed.tensor" not in sys.modules:
        return model  # nothing imported DTensor, so no parameter can be one (and start-up stays light)
    from torch.distributed.tensor import DTensor, Shard

    family = model.args.family
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Embedding)) or not isinstance(module.weight, DTensor):
            continue
        if isinstance(module, nn.Linear) and module.bias is not None:
            raise NotImplementedError(f"{name}: a Linear with a bias cannot be localized")
        weight: DTensor = module.weight
        dim = tp_sharding(name, family).dim
        if dim is None or tuple(weight.placements) != (Shard(dim),):
            raise ValueError(f"{name}.weight is placed {weight.placements}, the layout says Shard({dim})")
        pg = group if group is not None else weight.device_mesh.get_group()
        if dist.get_rank(pg) != weight.device_mesh.get_local_rank():
            raise ValueError(f"{name}: rank {dist.get_rank(pg)} in the group is not its mesh coordinate")
        local = weight.to_local().detach()
        if local.shape[dim] * dist.get_world_size(pg) != weight.shape[dim]:
            raise ValueError(f"{name}.weight: local {tuple(local.shape)} is not an even 1/tp of {tuple(weight.shape)}")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, local_module(name, local, family, pg))
    leftover = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if leftover:
        raise ValueError(f"parameters still DTensor after localize: {leftover}")
    return model
