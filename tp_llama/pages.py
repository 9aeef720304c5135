"""Memory for the tiled weights on 2 MiB pages, where Linux gives them.

A decode step streams every weight from memory once. On 4 KiB pages that stream crosses a page,
and misses the TLB, every 64 cache lines; 2 MiB pages take those misses out of the stream
(bench/engine/step.py). Linux gives an anonymous mapping 2 MiB pages when transparent huge pages
are `always`, or `madvise` and the mapping asks (MADV_HUGEPAGE, as here); with `never`, or where
the request fails, the memory is ordinary.

The cost is at load: a fresh 2 MiB page is slow to touch first, where 4 KiB pages reuse the
memory the checkpoint was just read into (bench/engine/load.py), paid once for every decode step
after (bench/engine/step.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
SMAPS = Path("/proc/self/smaps_rollup")


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor whose memory starts on a 2 MiB boundary and asks for 2 MiB pages.

    Small tensors (under one page) and systems without MADV_HUGEPAGE get torch.empty.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return torch.empty(shape, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a boundary
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)  # holds `area` alive as long as any view of it
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        area.madvise(advice, start, size - start)
    except OSError:  # a kernel without transparent huge pages: ordinary pages, same layout
        pass
    return whole[start:start + nbytes].view(dtype).view(shape)


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory on 2 MiB pages (None where Linux does not say)."""
    try:
        for line in SMAPS.read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def give_back_free_memory() -> None:
    """Return the C heap's free memory to the system (glibc's malloc_trim; elsewhere nothing).

    A load frees its 16-bit tensors as it prepares each block, but glibc keeps freed chunks its
    growing mmap threshold moved onto the heap, and a worker would hold them for its lifetime
    (bench/engine/memory.py)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return
    if trim is not None:
        trim(0)
