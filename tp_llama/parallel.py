"""Parallel plans: tensor parallel (parallelize_module) and FSDP, over one mesh of all ranks.

Tensor parallelism loads into DTensor parameters (parallelize_module), then `localize` turns the
model into plain local shards with explicit collectives for inference: DTensor's per-op Python
dispatch costs more than the matmuls of a decode step on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from tp_llama.layout import shard_dim
from tp_llama.model import Transformer, TransformerBlock


# The model's edges: whole activations go in after the embedding and whole logits come out.
EDGES = ("tok_embeddings", "output")


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
        if name in EDGES:
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


# torch 2.13 renamed all_gather_into_tensor; both take the concatenation along dim 0.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum the ranks' partial results, in place."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate the ranks' [..., n] pieces, in rank order, into [..., tp * n]."""
    tp = dist.get_world_size(group)
    x = x.contiguous()
    gathered = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x, group=group)
    return gathered.unflatten(0, (tp, x.shape[0])).movedim(0, -2).flatten(-2)


# What a module's output is when its weight is sharded along a dim (the other dim: partial sums).
# Linear weight [out, in]: rows (dim 0) shard the output features. Embedding [vocab, dim]: columns do.
def _sharded_output_dim(module: nn.Module) -> int:
    return 0 if isinstance(module, nn.Linear) else 1


class LocalLinear(nn.Module):
    """A Linear on this rank's shard of the weight, then the collective its split needs (inference only).

    comm: "none" (the output stays sharded on the features: column parallel, feeding local
    attention heads or FFN rows), "all_reduce" (row parallel: partial sums over the input
    features) or "all_gather" (column parallel at the model's edge: whole features wanted).
    """

    def __init__(self, weight: torch.Tensor, comm: str, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.comm, self.group = comm, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.comm == "all_reduce":
            return all_reduce_sum(out, self.group)
        if self.comm == "all_gather":
            return all_gather_last_dim(out, self.group)
        return out

    def extra_repr(self) -> str:
        return f"local {tuple(self.weight.shape)}, {self.comm}"


class LocalEmbedding(nn.Module):
    """An Embedding on this rank's shard of the table, then the collective its split needs (inference only).

    comm "all_gather": the table is split on the embedding dim (Llama 1/2), every rank looks up
    every id and the [.., dim/tp] pieces are gathered. comm "all_reduce": the table is split on
    the vocabulary (Llama 3), rows [vocab_start, vocab_start + local rows); ids outside give
    zeros here and their row on the rank that holds it, and the sum is the lookup.
    """

    def __init__(self, weight: torch.Tensor, comm: str, group: dist.ProcessGroup, vocab_start: int = 0):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.comm, self.group, self.vocab_start = comm, group, vocab_start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm == "all_reduce":
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.weight.shape[0])
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            return all_reduce_sum(out.masked_fill_(outside.unsqueeze(-1), 0), self.group)
        out = F.embedding(ids, self.weight)
        return all_gather_last_dim(out, self.group) if self.comm == "all_gather" else out

    def extra_repr(self) -> str:
        return f"local {tuple(self.weight.shape)}, {self.comm}, vocab_start={self.vocab_start}"


@torch.no_grad()
def localize(model: Transformer, group: dist.ProcessGroup | None = None) -> Transformer:
    """Replace the DTensor-sharded Linears and Embedding by plain local shards with explicit collectives.

    Run once after loading (load_tp_model); a model without DTensor parameters is left as it is.
    The communication of each module comes from layout.shard_dim: a weight split so that the
    output is partial sums is all-reduced; one split on the output features stays sharded inside
    a block (attention and the FFN work on their local heads and rows) and is all-gathered at the
    model's edges (tok_embeddings, output), where every rank needs whole activations and logits.
    The new modules keep the parameter names, so state_dict still uses Meta's names (local shards).
    """
    family = model.args.family
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Embedding)) or not isinstance(module.weight, DTensor):
            continue
        if isinstance(module, nn.Linear) and module.bias is not None:
            raise NotImplementedError(f"{name}: a Linear with a bias cannot be localized")
        weight: DTensor = module.weight
        dim = shard_dim(f"{name}.weight", family)
        if dim is None or tuple(weight.placements) != (Shard(dim),):
            raise ValueError(f"{name}.weight is placed {weight.placements}, the layout says Shard({dim})")
        pg = group if group is not None else weight.device_mesh.get_group()
        if dist.get_rank(pg) != weight.device_mesh.get_local_rank():
            raise ValueError(f"{name}: rank {dist.get_rank(pg)} in the group is not its mesh coordinate")
        local = weight.to_local().detach()
        if local.shape[dim] * dist.get_world_size(pg) != weight.shape[dim]:
            raise ValueError(f"{name}.weight: local {tuple(local.shape)} is not an even 1/tp of {tuple(weight.shape)}")
        if dim != _sharded_output_dim(module):
            comm = "all_reduce"
        else:
            comm = "all_gather" if name in EDGES else "none"
        if isinstance(module, nn.Embedding):
            start = dist.get_rank(pg) * local.shape[0] if dim == 0 else 0
            replacement: nn.Module = LocalEmbedding(local, comm, pg, start)
        else:
            replacement = LocalLinear(local, comm, pg)
        parent_name, _, child = name.rpartition(".")
        # Swapping the module drops parallelize_module's input/output hooks with it.
        setattr(model.get_submodule(parent_name), child, replacement)
    leftover = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if leftover:
        raise ValueError(f"parameters still DTensor after localize: {leftover}")
    return model
