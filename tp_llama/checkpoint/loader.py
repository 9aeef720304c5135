"""Loading a consolidated checkpoint: local tensor-parallel shards (direct, `tp`) or FSDP (seed, `fsdp`).

Direct path: each rank reads only its slices (tp_llama.checkpoint.reader) into plain local
modules (parallel.modules.local_module, layout.TP_TABLE).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from tp_llama.checkpoint.reader import Piece, ShardFiles, local_shape, plan_local_shard, read_pieces
from tp_llama.checkpoint.shards import check_keys, find_shards, load_shard
from tp_llama.errors import CheckpointError
from tp_llama.model import ModelArgs, Transformer
from tp_llama.parallel.distributed import DistInfo, every_rank_agrees, log
from tp_llama.parallel.layout import check_tp_size, full_shapes, shard_dim
from tp_llama.parallel.modules import local_module

if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class _SkipInit(TorchFunctionMode):
    """Skips torch.nn.init while building a meta-device skeleton (random init of meta tensors is
    pointless, and meta normal_ goes through torch._refs, which imports torch._dynamo)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def build_local_model(
    args: ModelArgs, state: dict[str, torch.Tensor], tp: int, group: dist.ProcessGroup | None = None
) -> Transformer:
    """A Transformer holding `state` (this rank's shards, Meta's names): local modules for tp > 1."""
    with torch.device("meta"), _SkipInit():
        model = Transformer(args)
    if tp > 1:
        for name, module in list(model.named_modules()):
            if isinstance(module, (nn.Linear, nn.Embedding)):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, local_module(name, state[f"{name}.weight"], args.family, group))
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False)


def load_tp_model(ckpt_dir: str | Path, args: ModelArgs, info: DistInfo, dtype: torch.dtype) -> Transformer:
    """Direct path: each rank reads only its slices, straight into its local modules' weights.

    The model stays on the host: the backend fuses its weights there before they move to
    `info.device` (tp_llama.engine.core.load_model).
    """
    tp, rank = info.world_size, info.rank
    expected = full_shapes(args)
    start = time.perf_counter()
    state: dict[str, torch.Tensor] = {}
    with every_rank_agrees():
        check_tp_size(args, tp)
        files = ShardFiles(find_shards(ckpt_dir), expected)
        pieces: list[tuple[int, Piece]] = []
        for key, full in expected.items():
            dim = shard_dim(key, args.family) if tp > 1 else None
            state[key] = torch.empty(local_shape(full, dim, tp), dtype=dtype)
            pieces += plan_local_shard(files, key, full, dim, rank, tp, state[key])
        read_pieces(files, pieces)
        del pieces
        files.close()
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        log(f"read {nbytes / 1e6:.0f} MB from {len(files.files_read())} of {len(files)} shard files "
            f"{[p.name for p in files.files_read()]} in {time.perf_counter() - start:.1f} s", rank)
    return build_local_model(args, state, tp, dist.group.WORLD if tp > 1 else None)


def load_fsdp_model(ckpt_dir: str | Path, args: ModelArgs, info: DistInfo, dtype: torch.dtype) -> FSDP:
    """Seed path: each rank loads the file of MP rank (rank % MP), then the converter and FSDP."""
    # FSDP, DTensor and the converter import torch._dynamo: only this mode pays for them.
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    from torch.distributed.tensor import DTensor

    from tp_llama.parallel.converter import build_distributed_state_dict_from_consolidated
    from tp_llama.parallel.fsdp import apply_fsdp, make_mesh

    paths = find_shards(ckpt_dir)
    mp = len(paths)
    if info.world_size % mp:
        raise CheckpointError(
            f"fsdp mode needs a world size that is a multiple of the checkpoint's MP size {mp}, "
            f"got {info.world_size}; use mode 'tp' to reshard"
        )
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    with every_rank_agrees():
        path = paths[info.rank % mp]
        consolidated = load_shard(path)
        check_keys(consolidated, full_shapes(args), path)
        for key, tensor in consolidated.items():
            consolidated[key] = tensor.to(dtype)
    start = time.perf_counter()
    state = build_distributed_state_dict_from_consolidated(model, consolidated, mp, use_dtensor=True)
    del consolidated
    log(f"converted {len(state)} tensors to DTensor FSDP shards ({time.perf_counter() - start:.1f} s)", info.rank)
    if info.world_size == 1:  # FSDP1 runs NO_SHARD alone and wants plain tensors
        state = {key: value.to_local() if isinstance(value, DTensor) else value for key, value in state.items()}
    wrapped = apply_fsdp(model, make_mesh(info.device, info.world_size), info.device)
    with FullyShardedDataParallel.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
        wrapped.load_state_dict(state)
    return wrapped
