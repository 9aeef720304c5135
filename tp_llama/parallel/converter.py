"""Seed converter: fairscale consolidated shards -> ShardedTensor/DTensor state dict for FSDP.

Each rank holds the consolidated shard of MP rank (rank % MP). Ranks [k*MP, (k+1)*MP) form a
model-parallel group: they all-gather each tensor back to full size, then every rank keeps its
FSDP chunk (dim 0, world_size chunks). Which tensors were split comes from
layout.TP_TABLE, the table the direct loader reads; `_is_tp_sharded` keeps the seed's name test
for callers of the seed API. This is the reference path; the direct tensor-parallel loader
(tp_llama.checkpoint.loader) never materialises whole tensors.
"""

from __future__ import annotations

from typing import Dict, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fsdp_extensions import _ext_chunk_dtensor, _ext_chunk_tensor
from torch.distributed.tensor import DTensor

from tp_llama.errors import CheckpointError
from tp_llama.parallel.distributed import collective_timeout, every_rank_agrees
from tp_llama.parallel.layout import is_ignored, is_sharded, source_split_dim


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a group's collectives run: CUDA for nccl, CPU for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _verify_fqn_across_ranks(fqn: str, grp_gloo: dist.ProcessGroup) -> None:
    """Every rank must be at the same parameter, or the next all-gather mixes tensors."""
    fqns: list[str | None] = [None] * dist.get_world_size(grp_gloo)
    dist.all_gather_object(fqns, fqn, group=grp_gloo)
    if any(other != fqn for other in fqns):
        raise AssertionError(f"ranks are at different parameters: {fqns}")


def _all_gather_into_list(data_tensor: Tensor, model_parallel_group: dist.ProcessGroup) -> list[Tensor]:
    """Every rank's shard of one tensor, on the group's device."""
    local = data_tensor.to(_group_device(model_parallel_group)).contiguous()
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size(model_parallel_group))]
    dist.all_gather(gathered, local, group=model_parallel_group)
    return gathered


def _is_tp_sharded(fqn: str) -> bool:
    """Name heuristic from the seed: these modules were split by fairscale (norms inside them too,
    which _unshard_param then passes through because their shapes already match)."""
    return any(name in fqn for name in ("attention", "feed_forward", "output", "tok_embeddings"))


def _unshard_param(
    ref_state_dict: Dict[str, Tensor],
    fqn: str,
    model_parallel_group: dist.ProcessGroup,
    grp_gloo: dist.ProcessGroup,
    data_tensor: Tensor,
    tp_sharded_shape: torch.Size,
) -> tuple[Tensor, torch.Size]:
    """Rebuild the full tensor: stack rows if dim 0 was split, columns if dim 1 was."""
    _verify_fqn_across_ranks(fqn, grp_gloo)
    ref_shape = ref_state_dict[fqn].shape
    shard_shape = torch.Size(tp_sharded_shape)
    if shard_shape == ref_shape:
        return data_tensor, ref_shape
    mp = dist.get_world_size(model_parallel_group)
    shard = data_tensor.reshape(shard_shape)
    if len(ref_shape) == 2 and ref_shape[0] == shard_shape[0] * mp and ref_shape[1] == shard_shape[1]:
        full = torch.vstack(_all_gather_into_list(shard, model_parallel_group))
    elif len(ref_shape) == 2 and ref_shape[1] == shard_shape[1] * mp and ref_shape[0] == shard_shape[0]:
        full = torch.column_stack(_all_gather_into_list(shard, model_parallel_group))
    else:
        raise CheckpointError(
            f"tensor {fqn!r}: shard shape {tuple(shard_shape)} is no row or column split of "
            f"{tuple(ref_shape)} over {mp} ranks"
        )
    return full, full.shape


def _check_shards(ref_state_dict: Dict[str, Tensor], consolidated_state_dict: Dict[str, Tensor], mp: int) -> None:
    """Local shape checks before any collective, so a bad shard is an error and not a hang."""
    for fqn, tensor in consolidated_state_dict.items():
        if is_ignored(fqn):
            continue
        if fqn not in ref_state_dict:
            raise CheckpointError(f"unexpected tensor {fqn!r} (the model has no such parameter)")
        split = source_split_dim(fqn, tuple(ref_state_dict[fqn].shape), tuple(tensor.shape), mp, "consolidated shard")
        if split is not None and (split > 1 or not is_sharded(fqn)):
            raise CheckpointError(f"consolidated shard: tensor {fqn!r} is split, but fairscale never splits it")
    missing = [k for k in ref_state_dict if k not in consolidated_state_dict]
    if missing:
        raise CheckpointError(f"consolidated shard: missing tensor {missing[0]!r}")


def _check_alike_on_every_rank(consolidated_state_dict: Dict[str, Tensor], mp: int,
                               grp_gloo: dist.ProcessGroup) -> None:
    """Every rank's shard of each tensor has one shape and dtype (fairscale splits evenly): a rank holding a
    tensor whole where another holds a split of it would skip the all-gather the other waits in."""
    mine = {fqn: (tuple(t.shape), t.dtype) for fqn, t in consolidated_state_dict.items() if not is_ignored(fqn)}
    every: list[dict | None] = [None] * dist.get_world_size(grp_gloo)
    dist.all_gather_object(every, mine, group=grp_gloo)
    for rank, theirs in enumerate(every[1:], start=1):
        for fqn, (shape, dtype) in every[0].items():
            if theirs.get(fqn) != (shape, dtype):
                other = theirs.get(fqn, ("none", "missing"))
                raise CheckpointError(
                    f"consolidated shard: tensor {fqn!r} is {dtype} {shape} on rank 0 (MP rank 0) but {other[1]} "
                    f"{other[0]} on rank {rank} (MP rank {rank % mp}): the files split it differently")


def _in_model_order(ref_state_dict: Dict[str, Tensor], consolidated_state_dict: Dict[str, Tensor]) -> list[str]:
    """The model's parameter names in its own order, then the shard's RoPE tables: every rank must reach each
    tensor's all-gather together, and two ranks' dicts need not list their tensors alike (one rebuilt or
    filtered by hand). _check_shards has made sure both hold the same parameters."""
    return list(ref_state_dict) + [fqn for fqn in consolidated_state_dict if is_ignored(fqn)]


def build_distributed_state_dict_from_consolidated(
    model: nn.Module,
    consolidated_state_dict: Dict[str, Tensor],
    model_parallel_world_size: int,
    offload_to_cpu: bool = False,
    use_dtensor: bool = False,
) -> Dict[str, Union[Tensor, DTensor, ShardedTensor]]:
    """Turn this rank's consolidated shard into FSDP SHARDED_STATE_DICT entries.

    `model` is the unwrapped model (only its state-dict shapes are read; meta tensors are fine).
    Returns ShardedTensor values, or DTensor (Shard(0) on a 1-D mesh over all ranks) with
    use_dtensor=True; with offload_to_cpu the results live in CPU memory on a gloo group. On one rank the
    values are plain whole tensors: FSDP runs a world of one as NO_SHARD, which loads only those.
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    mp = model_parallel_world_size
    if mp < 1 or world_size % mp:
        raise ValueError(f"world size {world_size} is not a multiple of the model-parallel size {mp}")
    ref_state_dict = model.state_dict()
    timeout = collective_timeout()  # a new group's own default is torch's (30 minutes), not the world group's
    grp_gloo = dist.new_group(backend="gloo", timeout=timeout)
    model_parallel_group, _ = dist.new_subgroups(group_size=mp, timeout=timeout)
    compute_device = _group_device(None)
    with every_rank_agrees(grp_gloo):
        _check_shards(ref_state_dict, consolidated_state_dict, mp)
    with every_rank_agrees(grp_gloo):
        _check_alike_on_every_rank(consolidated_state_dict, mp, grp_gloo)

    chunk_group = grp_gloo if offload_to_cpu else dist.group.WORLD
    chunk_device = torch.device("cpu") if offload_to_cpu else compute_device
    mesh = _mesh_over(chunk_group, chunk_device) if use_dtensor and world_size > 1 else None
    devices_per_node = max(torch.cuda.device_count(), 1) if chunk_device.type == "cuda" else 1

    dist_state_dict: Dict[str, Union[Tensor, DTensor, ShardedTensor]] = {}
    for fqn in _in_model_order(ref_state_dict, consolidated_state_dict):
        tensor = consolidated_state_dict[fqn]
        if is_ignored(fqn):  # the seed's `"rope.freqs" in fqn`: Llama 2's table and the original LLaMA's per layer
            dist_state_dict[fqn] = tensor.clone()
            continue
        if is_sharded(fqn):
            tensor, _ = _unshard_param(ref_state_dict, fqn, model_parallel_group, grp_gloo, tensor, tensor.shape)
        tensor = tensor.to(chunk_device).contiguous()
        if world_size == 1:
            dist_state_dict[fqn] = tensor
        elif mesh is not None:
            dist_state_dict[fqn] = _ext_chunk_dtensor(tensor=tensor, rank=rank, device_mesh=mesh)
        else:
            dist_state_dict[fqn] = _ext_chunk_tensor(
                tensor=tensor, rank=rank, world_size=world_size, num_devices_per_node=devices_per_node, pg=chunk_group
            )
    return dist_state_dict


def _mesh_over(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    if group is dist.group.WORLD:
        return init_device_mesh(device.type, (dist.get_world_size(),))
    return DeviceMesh.from_group(group, device.type)
