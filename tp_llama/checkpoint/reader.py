"""Reading this rank's slices of a checkpoint's tensors with positioned reads.

For every tensor, each rank works out the intersection of its slice with each file's slice (any
MP onto any TP), finds where those bytes lie in the file, and reads them with os.preadv straight
into the tensor that will hold them, each file once and in file order. No page of a file stays
mapped and no whole tensor exists.
"""

from __future__ import annotations

import bisect
import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tp_llama.checkpoint.shards import check_keys, load_shard
from tp_llama.errors import CheckpointError
from tp_llama.parallel.layout import source_split_dim

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

    def __init__(self, paths: list[Path], expected: dict[str, tuple[int, ...]],
                 check: Callable[[dict[str, torch.Tensor], Path], None] | None = None,
                 rename: Callable[[dict[str, torch.Tensor], Path], dict[str, torch.Tensor]] | None = None):
        self.paths = paths
        self.expected = expected
        self.check = check  # the format's own checks of a file's tensors (checkpoint.quantized.Layout)
        # A download under other names than the model's (checkpoint/llama4_keys.py): checks the file's own
        # keys and gives the model's parameters as views of its tensors.
        self.rename = rename
        self._open: dict[int, dict[str, torch.Tensor]] = {}
        self._offsets: dict[int, dict[str, int | None]] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def _load(self, mp_rank: int) -> None:
        path = self.paths[mp_rank]
        state = load_shard(path)
        if self.rename is not None:
            state = self.rename(state, path)
        check_keys(state, self.expected, path)
        if self.check is not None:
            self.check(state, path)
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
