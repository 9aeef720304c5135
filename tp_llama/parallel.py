"""Tensor-parallel modules with explicit collectives, and the DTensor / FSDP plans.

The `tp` mode runs plain local shards (LocalLinear, LocalEmbedding) with the collective each
weight's split needs, all taken from layout.TP_TABLE; the loader builds them straight from the
file slices (DTensor's per-op Python dispatch costs more than a CPU decode step's matmuls).

The DTensor plan (tp_plan, apply_tensor_parallel) stays as a test oracle, and FSDP serves the
`fsdp` mode: both import their torch.distributed packages (and with them torch._dynamo) only
when called, so that importing this module (the serving start-up) stays cheap.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tp_llama.kernels import linear, prepare
from tp_llama.layout import ALL_GATHER, ALL_REDUCE, NONE, tp_sharding

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor.parallel import ParallelStyle

    from tp_llama.model import Transformer


def make_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,))


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
        if rule.comm == ALL_GATHER or isinstance(module, nn.Embedding):
            # Gather at the edges so every rank sees whole activations and whole logits.
            plan[name] = style(input_layouts=Replicate(), output_layouts=Replicate())
        else:
            plan[name] = style()
    return plan


def apply_tensor_parallel(model: Transformer, mesh: DeviceMesh) -> Transformer:
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, tp_plan(model))


def apply_fsdp(model: Transformer, mesh: DeviceMesh, device: torch.device) -> FSDP:
    """FSDP1 with one unit per block; built over the mesh so it takes DTensor state dicts too."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from tp_llama.model import TransformerBlock

    return FullyShardedDataParallel(
        model,
        device_mesh=mesh,
        auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
        device_id=device,
        param_init_fn=lambda m: m.to_empty(device=device, recurse=False),
        use_orig_params=True,
    )


# torch 2.13 renamed all_gather_into_tensor; both take the concatenation along dim 0.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum the ranks' partial results, in place."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate the ranks' [..., n] pieces, in rank order, into [..., tp * n]."""
    tp = dist.get_world_size(group)
    x = x.contiguous()
    gathered = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x, group=group)
    return gathered.unflatten(0, (tp, x.shape[0])).movedim(0, -2).flatten(-2)


class LocalLinear(nn.Module):
    """A Linear on this rank's shard of the weight, then the collective its split needs (inference only).

    comm (layout.TP_TABLE): "none" (the output stays sharded on the features: column parallel, feeding local
    attention heads or FFN rows), "all_reduce" (row parallel: partial sums over the input
    features) or "all_gather" (column parallel at the model's edge: whole features wanted).
    """

    def __init__(self, weight: torch.Tensor, comm: str, group: dist.ProcessGroup | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.comm, self.group = comm, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.communicate(linear(x, self.weight))

    def communicate(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's product as the whole layer's output (all-reduced in place)."""
        if self.comm == ALL_REDUCE:
            return all_reduce_sum(out, self.group)
        if self.comm == ALL_GATHER:
            return all_gather_last_dim(out, self.group)
        return out

    def prepare(self, kind: str) -> None:
        """Swap the weight for its form for `kind` of matmul (kernels.prepare); inference only from then on."""
        prepared = prepare(self.weight, kind)
        del self.weight
        self.weight = prepared

    def extra_repr(self) -> str:
        return f"local {tuple(self.weight.shape)}, {self.comm}"


class LocalEmbedding(nn.Module):
    """An Embedding on this rank's shard of the table, then the collective its split needs (inference only).

    comm "all_gather": the table is split on the embedding dim (Llama 1/2), every rank looks up
    every id and the [.., dim/tp] pieces are gathered. comm "all_reduce": the table is split on
    the vocabulary (Llama 3), rows [vocab_start, vocab_start + local rows); ids outside give
    zeros here and their row on the rank that holds it, and the sum is the lookup.
    """

    def __init__(self, weight: torch.Tensor, comm: str, group: dist.ProcessGroup | None, vocab_start: int = 0):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.comm, self.group, self.vocab_start = comm, group, vocab_start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm == ALL_REDUCE:
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.weight.shape[0])
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            return all_reduce_sum(out.masked_fill_(outside.unsqueeze(-1), 0), self.group)
        out = F.embedding(ids, self.weight)
        return all_gather_last_dim(out, self.group) if self.comm == ALL_GATHER else out

    def extra_repr(self) -> str:
        return f"local {tuple(self.weight.shape)}, {self.comm}, vocab_start={self.vocab_start}"


def local_module(name: str, weight: torch.Tensor, family: str, group: dist.ProcessGroup | None) -> nn.Module:
    """The tensor-parallel module `name` (Meta's name) on this rank's shard `weight` of its table.

    The shard dim and the collective come from layout.TP_TABLE. An embedding sharded on its
    vocabulary rows learns where its rows start from the rank (rank r holds rows r*n .. r*n+n-1).
    """
    rule = tp_sharding(name, family)
    if rule.dim is None or rule.comm not in (NONE, ALL_REDUCE, ALL_GATHER):
        raise ValueError(f"{name}: TP_TABLE gives no sharded module ({rule})")
    if name.rpartition(".")[2] == "tok_embeddings":
        start = dist.get_rank(group) * weight.shape[0] if rule.dim == 0 else 0
        return LocalEmbedding(weight, rule.comm, group, start)
    return LocalLinear(weight, rule.comm, group)


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
