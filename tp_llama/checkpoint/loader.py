"""Loading a consolidated checkpoint: local tensor-parallel shards (direct, `tp`) or FSDP (seed, `fsdp`).

Direct path: each rank reads only its slices (tp_llama.checkpoint.reader) into plain local
modules (parallel.modules.local_module, layout.TP_TABLE); given a preparer (the serving backend), one
layer at a time, each prepared for serving before the next is read, so a load holds the prepared
layers (quantized ones are a fraction of their size) plus one layer as read, not the whole model as read.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from tp_llama.checkpoint.formats import read_format
from tp_llama.checkpoint.llama4_keys import Llama4Files
from tp_llama.checkpoint.quantized import Layout
from tp_llama.checkpoint.reader import Piece, ShardFiles, local_shape, plan_local_shard, read_pieces
from tp_llama.checkpoint.shards import check_float_dtypes, check_keys, find_shards, load_shard
from tp_llama.errors import CheckpointError
from tp_llama.kernels import C_KINDS
from tp_llama.model import ModelArgs, Transformer, build
from tp_llama.parallel.distributed import DistInfo, every_rank_agrees, log
from tp_llama.parallel.layout import check_tp_size, full_shapes
from tp_llama.parallel.modules import local_module
from tp_llama.pages import give_back_free_memory

if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class _SkipInit(TorchFunctionMode):
    """Skips torch.nn.init while building a meta-device skeleton (random init of meta tensors is
    pointless, and meta normal_ goes through torch._refs, which imports torch._dynamo)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


class Preparer(Protocol):
    """What the serving backend does to a model as it is read (tp_llama.backend.Preparation)."""

    bits: int  # 16: the weights as read; 8 or 4: quantized at load (refused for a quantized checkpoint)
    kind: str  # the kind of matmul this process runs (tp_llama.kernels.choose)

    def layer(self, block: nn.Module, name: str) -> None: ...

    def top(self, model: Transformer) -> None: ...


def skeleton(args: ModelArgs) -> Transformer:
    with torch.device("meta"), _SkipInit():
        return build(args)


def assign(model: Transformer, state: dict[str, torch.Tensor], family: str, group: dist.ProcessGroup | None) -> None:
    """`state` (this rank's shards of some of the model's tensors, Meta's names) into the model: local
    modules for tensor parallelism (group not None)."""
    if group is not None:
        for key, tensor in state.items():
            name = key.removesuffix(".weight")
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent)
            module = getattr(owner, child)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                setattr(owner, child, local_module(name, tensor, family, group))
            elif isinstance(module, nn.Parameter):  # Llama 4's router and experts (model/llama4.py)
                setattr(owner, child, nn.Parameter(tensor, requires_grad=False))
                if hasattr(owner, "group"):  # a MoE all-reduces its partial sums itself
                    owner.group = group
    model.load_state_dict(state, strict=False, assign=True)


def build_local_model(
    args: ModelArgs, state: dict[str, torch.Tensor], tp: int, group: dist.ProcessGroup | None = None
) -> Transformer:
    """A Transformer holding `state` (this rank's shards, Meta's names): local modules for tp > 1."""
    model = skeleton(args)
    missing = set(full_shapes(args)) - set(state)
    if missing or set(state) - set(full_shapes(args)):
        raise KeyError(f"state and model differ: missing {sorted(missing)[:5]}, unexpected "
                       f"{sorted(set(state) - set(full_shapes(args)))[:5]}")
    assign(model, state, args.family, group if tp > 1 else None)
    return model.requires_grad_(False)


def _groups(keys: list[str]) -> list[tuple[str | None, list[str]]]:
    """Keys in the order a preparing load reads them: the embedding and final norm (None: nothing to
    prepare, and a checkpoint that disagrees with params.json fails on its first tensor), each layer
    ("layers.3"), then the output layer."""
    layers: dict[str, list[str]] = {}
    for key in keys:
        if key.startswith("layers."):
            layers.setdefault(".".join(key.split(".")[:2]), []).append(key)
    last = [key for key in keys if key.startswith("output.")]
    first = [key for key in keys if not key.startswith("layers.") and key not in last]
    return [(None, first), *layers.items(), (None, last)]


def load_tp_model(ckpt_dir: str | Path, args: ModelArgs, info: DistInfo, dtype: torch.dtype,
                  prepare: Preparer | None = None) -> Transformer:
    """Direct path: each rank reads only its slices, straight into its local modules' weights.

    The model stays on the host: the backend fuses its weights there before they move to
    `info.device` (tp_llama.engine.core.load_model); with `prepare`, layer by layer as they are read.
    """
    tp, rank = info.world_size, info.rank
    group = dist.group.WORLD if tp > 1 else None
    start = time.perf_counter()
    model = skeleton(args).requires_grad_(False)
    nbytes = 0
    with every_rank_agrees():
        check_tp_size(args, tp)
        paths = find_shards(ckpt_dir)
        layout = quantized_layout(ckpt_dir, args, paths, tp, dtype, info.device, prepare)
        if layout.fmt.quantized:
            log(f"checkpoint format: {layout.fmt.describe()}", rank)
        llama4 = Llama4Files(args) if args.family == "llama4" else None
        if llama4 is not None and layout.fmt.quantized:
            raise CheckpointError(f"{ckpt_dir}: a Llama 4 checkpoint in {layout.fmt.describe()} is not served yet; "
                                  "use its bfloat16 download (handler.quantize quantizes it at load)")
        files = ShardFiles(paths, layout.full, layout.check_file, llama4)
        keys_in_order = list(layout.specs)
        for name, keys in _groups(keys_in_order) if prepare is not None else [(None, keys_in_order)]:
            state: dict[str, torch.Tensor] = {}
            pieces: list[tuple[int, Piece]] = []
            for key in keys:
                spec = layout.specs[key]
                dim = spec.dim if tp > 1 else None
                state[key] = torch.empty(local_shape(spec.full, dim, tp), dtype=spec.dtype)
                pieces += plan_local_shard(files, key, spec.full, dim, rank, tp, state[key])
            read_pieces(files, pieces)
            nbytes += sum(t.numel() * t.element_size() for t in state.values())
            layout.assemble(model, state, rank, tp, len(paths), group)
            assign(model, state, args.family, group)
            del state, pieces
            if prepare is not None and name is not None:
                prepare.layer(model.get_submodule(name), name)
        if prepare is not None:
            prepare.top(model)
            give_back_free_memory()
        files.close()
        if llama4 is not None and llama4.vision_skipped:
            log(f"{llama4.vision_skipped} tensors of the vision encoder in each file skipped: served text-only", rank)
        log(f"read {nbytes / 1e6:.0f} MB from {len(files.files_read())} of {len(files)} shard files "
            f"{[p.name for p in files.files_read()]} in {time.perf_counter() - start:.1f} s"
            + (" (each layer prepared for serving as read)" if prepare is not None else ""), rank)
    return model


def quantized_layout(ckpt_dir: str | Path, args: ModelArgs, paths: list[Path], tp: int, dtype: torch.dtype,
                     device: torch.device, prepare: Preparer | None) -> Layout:
    """The checkpoint's format and what a rank reads of it; quantizing at load is refused for a checkpoint
    that comes quantized (its weights would be quantized twice)."""
    fmt = read_format(ckpt_dir, len(paths))
    bits = getattr(prepare, "bits", 16)
    if fmt.quantized and bits != 16:
        asked = {8: "int8", 4: "int4"}.get(bits, f"{bits} bits")
        raise CheckpointError(
            f"{ckpt_dir}: quantize {asked!r} was asked for, but this checkpoint comes quantized "
            f"({fmt.describe()}): it is served in its own format; set quantize to none (handler.quantize in the "
            "yaml, --quantize on the command line)")
    return Layout.build(args, fmt, paths, tp, dtype, device, getattr(prepare, "kind", None) in C_KINDS)


def check_fsdp_world(mp: int, world_size: int) -> None:
    """fsdp mode's rule (make_archive checks it too, before a worker would refuse it at every retry): each rank
    reads whole shard files, so the world size is a multiple of the checkpoint's MP size."""
    if world_size % mp:
        raise CheckpointError(f"fsdp mode needs a world size that is a multiple of the checkpoint's MP size {mp}, "
                              f"got {world_size}; use mode 'tp' to reshard")


def load_fsdp_model(ckpt_dir: str | Path, args: ModelArgs, info: DistInfo, dtype: torch.dtype) -> FSDP:
    """Seed path: each rank loads the file of MP rank (rank % MP), then the converter and FSDP."""
    # FSDP, DTensor and the converter import torch._dynamo: only this mode pays for them.
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    from torch.distributed.tensor import DTensor

    from tp_llama.parallel.converter import build_distributed_state_dict_from_consolidated
    from tp_llama.parallel.fsdp import apply_fsdp, make_mesh

    if args.family == "llama4":
        raise CheckpointError(f"{ckpt_dir}: fsdp mode reads Llama 2 and 3 checkpoints; serve Llama 4 in mode 'tp'")
    paths = find_shards(ckpt_dir)
    mp = len(paths)
    fmt = read_format(ckpt_dir, mp)
    if fmt.quantized:
        raise CheckpointError(f"{ckpt_dir}: fsdp mode reads 16-bit checkpoints only, and this one is quantized "
                              f"({fmt.describe()}); use mode 'tp'")
    check_fsdp_world(mp, info.world_size)
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    with every_rank_agrees():
        path = paths[info.rank % mp]
        consolidated = load_shard(path)
        check_keys(consolidated, full_shapes(args), path)
        check_float_dtypes(consolidated, path, consolidated)
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
