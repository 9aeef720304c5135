"""Bring-up as a whole process: torchrun, load and 2 generated tokens, against a floor process.

    python -m bench.engine.bringup [--preset 1b-half] [--pairs 2:2 4:2 1:2 1:1] [--repeats 3]

floor: torchrun of TP ranks that import torch, join a gloo group (none for TP 1) and pread their share of the
checkpoint's bytes (1/TP of the total, from the files their slices live in): what any loader
must do. ours: `torchrun -m tp_llama.generate --max-new-tokens 2` on the same checkpoint, in the
checkpoint's dtype. Each run starts with the files evicted from the page cache; the time is the
wall time of the whole command, medians over the repeats, floor and ours taking turns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import drop_file_cache, table, torchrun, write_json
from tp_llama.checkpoint.shards import find_shards

CHUNK = 8 << 20


def read_share(ckpt: str) -> None:
    """The floor worker: this rank preads 1/TP of the checkpoint's bytes from the files it needs."""
    import torch.distributed as dist

    launched = "RANK" in os.environ  # one rank runs as a plain process, as ours does
    if launched:
        dist.init_process_group("gloo")
    rank, tp = (dist.get_rank(), dist.get_world_size()) if launched else (0, 1)
    paths = find_shards(ckpt)
    mp = len(paths)
    if mp >= tp:  # whole files: [rank*mp/tp, (rank+1)*mp/tp)
        ranges = [(p, 0, p.stat().st_size) for p in paths[rank * mp // tp : (rank + 1) * mp // tp]]
    else:  # part of one file
        path, parts = paths[rank * mp // tp], tp // mp
        size = path.stat().st_size // parts
        ranges = [(path, (rank % parts) * size, size)]
    buffer = bytearray(CHUNK)
    for path, start, length in ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset in range(start, start + length, CHUNK):
                os.preadv(fd, [memoryview(buffer)[: min(CHUNK, start + length - offset)]], offset)
        finally:
            os.close(fd)
    if launched:
        dist.barrier()
        dist.destroy_process_group()


def timed(ckpt, tp: int, floor: bool) -> float:
    drop_file_cache(find_shards(ckpt))
    started = time.perf_counter()
    if floor:
        torchrun("bench.engine.bringup", ["--floor-worker", str(ckpt)], tp, timeout=900)
    else:
        torchrun("tp_llama.generate", ["--ckpt-dir", str(ckpt), "--prompt", "Hello", "--max-new-tokens", "2",
                                       "--ignore-eos"], tp, timeout=900)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b-half")
    parser.add_argument("--pairs", nargs="+", default=["2:2", "4:2", "1:2", "1:1"], help="MP:TP")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--floor-worker", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.floor_worker:
        read_share(a.floor_worker)
        return
    rows, data = [], []
    for pair in a.pairs:
        mp, tp = map(int, pair.split(":"))
        ckpt = ensure_checkpoint(PRESETS[a.preset], mp)
        floor, ours = [], []
        for _ in range(a.repeats):
            floor.append(timed(ckpt, tp, floor=True))
            ours.append(timed(ckpt, tp, floor=False))
        f, o = statistics.median(floor), statistics.median(ours)
        rows.append([f"{mp}->{tp}", round(f, 2), round(o, 2), round(o / f, 2)])
        data.append({"mp": mp, "tp": tp, "floor_s": floor, "ours_s": ours})
        print(f"MP {mp} -> TP {tp}: floor {f:.2f} s, ours {o:.2f} s ({o / f:.2f}x)", flush=True)
    print(table(["MP->TP", "floor process s", "ours (load + 2 tokens) s", "ours / floor"], rows))
    print(f"raw numbers: {write_json('bringup', {'preset': a.preset, 'repeats': a.repeats, 'pairs': data})}")


if __name__ == "__main__":
    main()
