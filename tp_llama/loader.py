"""Loading a consolidated checkpoint: local tensor-parallel shards (direct, `tp`) or FSDP (seed, `fsdp`).

Direct path: each rank works out, for every tensor, the intersection of its slice with each
file's slice (any MP onto any TP), finds where those bytes lie in the file, and reads them with
positioned reads (os.preadv) straight into the parameter that will hold them, each file once and
in file order. No page of a file stays mapped, no DTensor is built, and no whole tensor exists.
The model is then assembled from plain local modules (parallel.local_module, layout.TP_TABLE).
"""

from __future__ import annotations

import bisect
import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from tp_llama.checkpoint import check_keys, find_shards, load_shard
from tp_llama.distributed import DistInfo, log, raise_if_any_rank_failed
from tp_llama.errors import CheckpointError
from tp_llama.layout import check_tp_size, full_shapes, shard_dim, source_split_dim
from tp_llama.model import Transformer
from tp_llama.parallel import local_module
from tp_llama.params import ModelArgs

if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

# Reads that cannot land straight in their destination (a column slice, a dtype conversion) go
# through one reusable buffer of this size, a block of whole rows at a time.
BLOCK_BYTES = 8 << 20
# A column slice whose rows are at least this long is read row by row straight into place.
ROW_DIRECT_BYTES = 1 << 20

Box = list[tuple[int, int]]  # [start, end) per dim


def _box(full: tuple[int, ...], dim: int | None, part: int, parts: int) -> Box:
    """Part `part` of `parts` along `dim` (the whole tensor for None)."""
    box = [(0, size) for size in full]
    if dim is not None:
        step = full[dim] // parts
        box[dim] = (part * step, (part + 1) * step)
    return box


def _mappings() -> list[tuple[int, int, int, int]]:
    """This process's file mappings as sorted (start, end, file offset, inode); [] where /proc is missing."""
    out = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or not fields[5].strip():
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                out.append((start, end, int(fields[2], 16), int(fields[4])))
    except OSError:
        return []
    return sorted(out)


class ShardFiles:
    """The shard files of a checkpoint; one is opened the first time a rank needs something from it.

    Opening a file is torch.load(mmap=True, weights_only=True) (checkpoint.load_shard): it checks
    the file and its keys and gives every tensor's dtype, shape and strides; the mapping also
    tells where each tensor's bytes start in the file. No weight page is read through it.
    """

    def __init__(self, paths: list[Path], expected: dict[str, tuple[int, ...]]):
        self.paths = paths
        self.expected = expected
        self._open: dict[int, dict[str, torch.Tensor]] = {}
        self._offsets: dict[int, dict[str, int | None]] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def _load(self, mp_rank: int) -> None:
        path = self.paths[mp_rank]
        state = load_shard(path)
        check_keys(state, self.expected, path)
        inode, maps = os.stat(path).st_ino, _mappings()
        starts = [m[0] for m in maps]
        offsets: dict[str, int | None] = {}
        for key, tensor in state.items():
            offsets[key] = None  # read through the mapping instead (unusual strides, no /proc)
            if tensor.dim() > 2 or not tensor.is_contiguous() or tensor.numel() == 0:
                continue
            ptr = tensor.data_ptr()
            i = bisect.bisect_right(starts, ptr) - 1
            if i >= 0 and ptr < maps[i][1] and maps[i][3] == inode:
                offsets[key] = ptr - maps[i][0] + maps[i][2]
        self._open[mp_rank], self._offsets[mp_rank] = state, offsets

    def tensor(self, mp_rank: int, key: str) -> torch.Tensor:
        """The file's tensor, memory-mapped (its shape, dtype; its bytes are read with `offset`)."""
        if mp_rank not in self._open:
            self._load(mp_rank)
        return self._open[mp_rank][key]

    def offset(self, mp_rank: int, key: str) -> int | None:
        """Where the file's row-major tensor starts in the file (None: copy it through the mapping)."""
        self.tensor(mp_rank, key)
        return self._offsets[mp_rank][key]

    def files_read(self) -> list[Path]:
        return [self.paths[m] for m in sorted(self._open)]

    def close(self) -> None:
        """Drop every mapping (the paths read stay listed)."""
        for state in self._open.values():
            state.clear()


@dataclass
class Piece:
    """One file's part of one tensor of this rank: src[box] goes into dst (a view of the rank's tensor)."""

    key: str
    src: torch.Tensor
    offset: int | None
    box: Box
    dst: torch.Tensor

    def first_byte(self) -> int:
        if self.offset is None:
            return -1
        cols = self.src.shape[-1]
        row = self.box[0][0] if self.src.dim() == 2 else 0
        return self.offset + (row * cols + self.box[-1][0]) * self.src.element_size()


def _file_split(files: ShardFiles, mp_rank: int, key: str, full: tuple[int, ...]) -> int | None:
    return source_split_dim(key, full, tuple(files.tensor(mp_rank, key).shape), len(files), files.paths[mp_rank])


def plan_local_shard(
    files: ShardFiles, key: str, full: tuple[int, ...], dim: int | None, tp_rank: int, tp: int, out: torch.Tensor
) -> list[tuple[int, Piece]]:
    """(file index, piece) for every file that holds part of this rank's slice of `key`, into `out`.

    Each file covers a box of the full tensor (1/MP along its split dim, found from its shape);
    the rank's piece of a file is the intersection of the rank's box with the file's box. A file
    whose box misses the rank's is never opened; a tensor every file holds whole is taken from
    the file lined up with the rank.
    """
    mp = len(files)
    want = _box(full, dim, tp_rank, tp)
    home = tp_rank * mp // tp  # the file lined up with this rank's start
    split = _file_split(files, home, key, full)
    pieces = []
    for m in [home] if split is None else range(mp):
        have = _box(full, split, m, mp)
        overlap = [(max(w[0], h[0]), min(w[1], h[1])) for w, h in zip(want, have)]
        if any(lo >= hi for lo, hi in overlap):
            continue
        if _file_split(files, m, key, full) != split:
            raise CheckpointError(f"{files.paths[m]}: tensor {key!r} is split differently from {files.paths[home].name}")
        dst = out
        for d, (lo, hi) in enumerate(overlap):
            dst = dst.narrow(d, lo - want[d][0], hi - lo)
        box = [(lo - h[0], hi - h[0]) for (lo, hi), h in zip(overlap, have)]
        pieces.append((m, Piece(key, files.tensor(m, key), files.offset(m, key), box, dst)))
    return pieces


def _pread_into(fd: int, offset: int, nbytes: int, address: int, path: Path, key: str) -> None:
    """Exactly nbytes of the file from offset into memory at address (a CPU tensor's data)."""
    if nbytes == 0:
        return
    view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CheckpointError(
                f"{path}: tensor {key!r}: the file ends at byte {offset + done}, inside the tensor's data (truncated?)"
            )
        done += got


class _Reader:
    """Runs a file's pieces with positioned reads, through one reusable buffer where needed."""

    def __init__(self, block_bytes: int = BLOCK_BYTES, row_direct_bytes: int = ROW_DIRECT_BYTES):
        self.block_bytes, self.row_direct_bytes = block_bytes, row_direct_bytes
        self.buffer: torch.Tensor | None = None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(max(nbytes, self.block_bytes), dtype=torch.uint8)
        return self.buffer

    def read_file(self, path: Path, pieces: list[Piece]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for piece in sorted(pieces, key=Piece.first_byte):
                self.read_piece(fd, path, piece)
        finally:
            os.close(fd)

    def read_piece(self, fd: int, path: Path, piece: Piece) -> None:
        src, dst, box = piece.src, piece.dst, piece.box
        if piece.offset is None:  # not a row-major tensor at a known place: copy through the mapping
            for d, (lo, hi) in enumerate(box):
                src = src.narrow(d, lo, hi - lo)
            dst.copy_(src)
            return
        # Row-major [rows, cols] (a 1-D tensor is one row): the piece is rows r0..r1, columns c0..c1.
        elt, cols = src.element_size(), src.shape[-1]
        (r0, r1), (c0, c1) = box if src.dim() == 2 else [(0, 1), box[0]]
        dst2d = dst if dst.dim() == 2 else dst.unsqueeze(0)
        same = dst.dtype == src.dtype
        row_bytes = (c1 - c0) * elt
        if same and dst2d.is_contiguous() and (c0 == 0 and c1 == cols or r1 - r0 == 1):
            # One contiguous byte range of the file onto one of the destination.
            offset = piece.offset + (r0 * cols + c0) * elt
            _pread_into(fd, offset, (r1 - r0) * row_bytes, dst2d.data_ptr(), path, piece.key)
            return
        if same and row_bytes >= self.row_direct_bytes and dst2d.stride(-1) == 1:
            for r in range(r0, r1):  # long rows: one read per row, straight into place
                offset = piece.offset + (r * cols + c0) * elt
                _pread_into(fd, offset, row_bytes, dst2d[r - r0].data_ptr(), path, piece.key)
            return
        # Blocks of rows into the buffer (the bytes from column c0 of the first row to c1 of the
        # last), then one strided copy into place, converting the dtype if needed.
        per_block = max(1, self.block_bytes // (cols * elt))
        for b0 in range(r0, r1, per_block):
            b1 = min(r1, b0 + per_block)
            nbytes = ((b1 - b0 - 1) * cols + (c1 - c0)) * elt
            buffer = self._buffer(nbytes)
            _pread_into(fd, piece.offset + (b0 * cols + c0) * elt, nbytes, buffer.data_ptr(), path, piece.key)
            block = buffer[:nbytes].view(src.dtype).as_strided((b1 - b0, c1 - c0), (cols, 1))
            dst2d[b0 - r0 : b1 - r0].copy_(block)


def read_pieces(files: ShardFiles, pieces: list[tuple[int, Piece]], reader: _Reader | None = None) -> None:
    """Every piece, file by file in file order, each file's pieces in the order of their bytes."""
    reader = reader or _Reader()
    by_file: dict[int, list[Piece]] = {}
    for m, piece in pieces:
        by_file.setdefault(m, []).append(piece)
    for m in sorted(by_file):
        reader.read_file(files.paths[m], by_file[m])


def local_shape(full: tuple[int, ...], dim: int | None, tp: int) -> tuple[int, ...]:
    return tuple(size // tp if d == dim else size for d, size in enumerate(full))


def read_local_shard(
    files: ShardFiles,
    key: str,
    full: tuple[int, ...],
    dim: int | None,
    tp_rank: int,
    tp: int,
    dtype: torch.dtype,
    device: torch.device,
    reader: _Reader | None = None,
) -> torch.Tensor:
    """This rank's piece of `key` (1/tp of `dim`, or all of it), read from the files that overlap it."""
    out = torch.empty(local_shape(full, dim, tp), dtype=dtype)
    read_pieces(files, plan_local_shard(files, key, full, dim, tp_rank, tp, out), reader)
    return out.to(device)


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
    """Direct path: each rank reads only its slices, straight into its local modules' weights."""
    tp, rank = info.world_size, info.rank
    expected = full_shapes(args)
    start = time.perf_counter()
    state: dict[str, torch.Tensor] = {}
    error = None
    try:
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
        if info.device.type != "cpu":
            for key in state:  # one tensor at a time, so host memory never holds two copies
                state[key] = state[key].to(info.device)
    except Exception as exc:  # forwarded to every rank below
        error = exc
    raise_if_any_rank_failed(error)
    return build_local_model(args, state, tp, dist.group.WORLD if tp > 1 else None)


def load_fsdp_model(ckpt_dir: str | Path, args: ModelArgs, info: DistInfo, dtype: torch.dtype) -> FSDP:
    """Seed path: each rank loads the file of MP rank (rank % MP), then the converter and FSDP."""
    # FSDP, DTensor and the converter import torch._dynamo: only this mode pays for them.
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    from torch.distributed.tensor import DTensor

    from tp_llama.checkpoint_converter import build_distributed_state_dict_from_consolidated
    from tp_llama.parallel import apply_fsdp, make_mesh

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
    with FullyShardedDataParallel.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
        wrapped.load_state_dict(state)
    return wrapped
