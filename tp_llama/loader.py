"""Loading a consolidated checkpoint into a tensor-parallel (direct) or FSDP (seed) model."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.tensor import DTensor, Shard

from tp_llama.checkpoint import check_keys, find_shards, load_shard
from tp_llama.checkpoint_converter import build_distributed_state_dict_from_consolidated
from tp_llama.distributed import DistInfo, log, raise_if_any_rank_failed
from tp_llama.errors import CheckpointError
from tp_llama.layout import check_tp_size, full_shapes, shard_dim, source_split_dim
from tp_llama.model import Transformer
from tp_llama.parallel import apply_fsdp, apply_tensor_parallel, make_mesh
from tp_llama.params import ModelArgs


class ShardFiles:
    """Opens (memory-maps) a shard file the first time a rank needs something from it."""

    def __init__(self, paths: list[Path], expected: dict[str, tuple[int, ...]]):
        self.paths = paths
        self.expected = expected
        self._open: dict[int, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def tensor(self, mp_rank: int, key: str) -> torch.Tensor:
        if mp_rank not in self._open:
            state = load_shard(self.paths[mp_rank])
            check_keys(state, self.expected, self.paths[mp_rank])
            self._open[mp_rank] = state
        return self._open[mp_rank][key]

    def files_read(self) -> list[Path]:
        return [self.paths[m] for m in sorted(self._open)]


def _file_split(files: ShardFiles, mp_rank: int, key: str, full: tuple[int, ...]) -> int | None:
    return source_split_dim(key, full, tuple(files.tensor(mp_rank, key).shape), len(files), files.paths[mp_rank])


def read_local_shard(
    files: ShardFiles,
    key: str,
    full: tuple[int, ...],
    dim: int | None,
    tp_rank: int,
    tp: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """This rank's piece of `key` (1/tp of `dim`, or all of it), copied from the files that overlap it.

    Each file covers a box of the full tensor (1/MP along its split dim, found from its shape);
    the piece is the intersection of the rank's box with each file's box. Works for any MP and TP.
    """
    mp = len(files)
    want = [(0, size) for size in full]
    if dim is not None:
        step = full[dim] // tp
        want[dim] = (tp_rank * step, (tp_rank + 1) * step)
    out = torch.empty([hi - lo for lo, hi in want], dtype=dtype, device=device)
    home = tp_rank * mp // tp  # the file lined up with this rank's start
    split = _file_split(files, home, key, full)
    for m in [home] if split is None else range(mp):
        have = [(0, size) for size in full]
        if split is not None:
            step = full[split] // mp
            have[split] = (m * step, (m + 1) * step)
        overlap = [(max(w[0], h[0]), min(w[1], h[1])) for w, h in zip(want, have)]
        if any(lo >= hi for lo, hi in overlap):
            continue
        if _file_split(files, m, key, full) != split:
            raise CheckpointError(f"{files.paths[m]}: tensor {key!r} is split differently from {files.paths[home].name}")
        src, dst = files.tensor(m, key), out
        for d, (lo, hi) in enumerate(overlap):
            src = src.narrow(d, lo - have[d][0], hi - lo)
            dst = dst.narrow(d, lo - want[d][0], hi - lo)
        dst.copy_(src)
    return out


def _progress(start: float, done: int, total: int, rank: int) -> None:
    if rank == 0 and (done == total or done % max(1, total // 4) == 0):
        log(f"loaded {done}/{total} tensors ({time.perf_counter() - start:.1f} s)", rank)


def load_tp_model(ckpt_dir: str | Path, args: ModelArgs, info: DistInfo, dtype: torch.dtype) -> Transformer:
    """Direct path: each rank reads only its slices, straight into DTensor parameters."""
    tp, rank = info.world_size, info.rank
    mesh = make_mesh(info.device, tp) if tp > 1 else None
    with torch.device("meta"):
        model = Transformer(args)
    if mesh is not None:
        apply_tensor_parallel(model, mesh)
    expected = full_shapes(args)
    start = time.perf_counter()
    state: dict[str, torch.Tensor] = {}
    error = None
    try:
        check_tp_size(args, tp)
        files = ShardFiles(find_shards(ckpt_dir), expected)
        for i, (key, full) in enumerate(expected.items(), 1):
            dim = shard_dim(key, args.family) if mesh is not None else None
            local = read_local_shard(files, key, full, dim, rank, tp, dtype, info.device)
            state[key] = local if dim is None else DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
            _progress(start, i, len(expected), rank)
        log(f"read {len(files.files_read())} of {len(files)} shard files: {[p.name for p in files.files_read()]}", rank)
        del files
    except Exception as exc:  # forwarded to every rank below
        error = exc
    raise_if_any_rank_failed(error)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def load_fsdp_model(ckpt_dir: str | Path, args: ModelArgs, info: DistInfo, dtype: torch.dtype) -> FSDP:
    """Seed path: each rank loads the file of MP rank (rank % MP), then the converter and FSDP."""
    paths = find_shards(ckpt_dir)
    mp = len(paths)
    if info.world_size % mp:
        raise CheckpointError(
            f"fsdp mode needs a world size that is a multiple of the checkpoint's MP size {mp}, "
            f"got {info.world_size}; use mode 'tp' to reshard"
        )
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    error, consolidated = None, {}
    try:
        path = paths[info.rank % mp]
        consolidated = load_shard(path)
        check_keys(consolidated, full_shapes(args), path)
        for key, tensor in consolidated.items():
            consolidated[key] = tensor.to(dtype)
    except Exception as exc:  # forwarded to every rank below
        error = exc
    raise_if_any_rank_failed(error)
    start = time.perf_counter()
    state = build_distributed_state_dict_from_consolidated(model, consolidated, mp, use_dtensor=True)
    del consolidated
    log(f"converted {len(state)} tensors to DTensor FSDP shards ({time.perf_counter() - start:.1f} s)", info.rank)
    if info.world_size == 1:  # FSDP1 runs NO_SHARD alone and wants plain tensors
        state = {key: value.to_local() if isinstance(value, DTensor) else value for key, value in state.items()}
    wrapped = apply_fsdp(model, make_mesh(info.device, info.world_size), info.device)
    with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
        wrapped.load_state_dict(state)
    return wrapped
