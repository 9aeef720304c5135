"""Loading benchmark: per-rank wall seconds, bytes read from disk and peak memory, four ways.

    python -m bench.engine.load [--preset 1b-half] [--pairs 1:1 2:2 4:2 1:2] [--repeats 3]
                                [--methods floor direct] [--repo OTHER_CHECKOUT]

For each MP:TP pair (checkpoint files : tensor-parallel ranks), one launch of TP ranks per repeat
runs every method in turn, each after evicting the checkpoint from the page cache (cold reads)
and resetting the kernel's peak-RSS counter:
  floor   pread exactly the bytes of this rank's slices into one buffer, nothing else;
  direct  tp_llama.checkpoint.loader.load_tp_model (positioned reads straight into the local modules' weights),
          each block prepared for serving (fused, repacked for the matmul kernel) as soon as it is read,
          as Engine.load does; direct-int8 and direct-int4 quantize the blocks too (handler.quantize);
  seed    tp_llama.checkpoint.loader.load_fsdp_model (converter + FSDP1), only where MP divides TP;
  merge   rank 0 torch.loads every file, concatenates them into the full state dict and
          scatters each rank its slice (what a user would otherwise write).
Memory is reported as the rank's resident set before any load (torch and torch._dynamo imported,
process group joined: the fixed cost) plus the peak a method added on top of it.
--repo runs the ranks from another checkout (a git worktree of an older commit: before/after)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import REPO, drop_file_cache, last_json, module_in, read_bytes, table, torchrun, write_json
from tp_llama.checkpoint.shards import find_shards
from tp_llama.parallel.distributed import DistInfo, init_distributed
from tp_llama.parallel.layout import full_shapes, shard_dim, source_split_dim
from tp_llama import backend
from tp_llama.checkpoint.loader import load_fsdp_model, load_tp_model
from tp_llama.model import Transformer
from tp_llama.checkpoint.params import read_params
from tp_llama.model import ModelArgs
from tp_llama.parallel.fsdp import make_mesh
from tp_llama.testing.oracle import apply_tensor_parallel

METHODS = ("floor", "direct", "direct-int8", "direct-int4", "seed", "merge")
DTYPE = torch.bfloat16  # the checkpoint's own dtype: loading is then pure reading, no conversion
# glibc raises its mmap threshold after the first large free, after which freed memory stays
# resident and the next method would reuse it unseen. Pinning the threshold at its initial
# value keeps large blocks mmap'd, so every method's peak is counted as in a fresh process.
FRESH_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def local_box(full: tuple[int, ...], dim: int | None, rank: int, tp: int) -> list[tuple[int, int]]:
    """[start, end) per dim of part `rank` of `tp` along `dim` (the whole tensor for None)."""
    box = [(0, size) for size in full]
    if dim is not None:
        step = full[dim] // tp
        box[dim] = (rank * step, (rank + 1) * step)
    return box


def share_bytes(args: ModelArgs, tp: int) -> int:
    """This rank's part of the weights in DTYPE: what it must end up holding."""
    elt = torch.finfo(DTYPE).bits // 8
    total = 0
    for key, full in full_shapes(args).items():
        dim = shard_dim(key, args.family) if tp > 1 else None
        total += torch.Size(full).numel() // (tp if dim is not None else 1) * elt
    return total


def mapped_base(path: Path) -> int:
    """Start address of the mmap torch.load made of `path` (mapped whole, from offset 0)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) == 6 and fields[5] == str(path.resolve()) and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    raise RuntimeError(f"{path} is not mapped")


def byte_ranges(view: torch.Tensor, base: int) -> list[tuple[int, int]]:
    """(file offset, length) runs that hold a narrowed view of a row-major file tensor."""
    elt = view.element_size()
    start = view.data_ptr() - base
    if view.dim() == 1 or view.is_contiguous():
        return [(start, view.numel() * elt)]
    rows, cols = view.shape
    return [(start + r * view.stride(0) * elt, cols * elt) for r in range(rows)]


def plan_reads(ckpt: Path, args: ModelArgs, rank: int, tp: int) -> dict[Path, list[tuple[int, int]]]:
    """Every byte range of every file that holds part of this rank's slices, adjacent runs merged.

    Uses the mmap torch.load only for tensor positions; no weight page is touched.
    """
    paths = find_shards(ckpt)
    mp = len(paths)
    plan: dict[Path, list[tuple[int, int]]] = {}
    for m, path in enumerate(paths):
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        base = mapped_base(path)
        runs: list[tuple[int, int]] = []
        for key, full in full_shapes(args).items():
            src = state[key]
            split = source_split_dim(key, full, tuple(src.shape), mp, path)
            if split is None and m != rank * mp // tp:
                continue  # replicated in every file: read from this rank's home file only
            have = local_box(full, split, m, mp)
            want = local_box(full, shard_dim(key, args.family) if tp > 1 else None, rank, tp)
            overlap = [(max(w[0], h[0]), min(w[1], h[1])) for w, h in zip(want, have)]
            if any(lo >= hi for lo, hi in overlap):
                continue
            for d, (lo, hi) in enumerate(overlap):
                src = src.narrow(d, lo - have[d][0], hi - lo)
            runs += byte_ranges(src, base)
        del state
        merged: list[tuple[int, int]] = []
        for offset, length in sorted(runs):
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((offset, length))
        if merged:
            plan[path] = merged
    return plan


def read_plan(plan: dict[Path, list[tuple[int, int]]]) -> torch.Tensor:
    """pread every range into one buffer the size of this rank's share."""
    total = sum(length for runs in plan.values() for _, length in runs)
    buffer = torch.empty(total, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    at = 0
    for path, runs in plan.items():
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, length in runs:
                while length:
                    got = os.preadv(fd, [view[at : at + length]], offset)
                    if got <= 0:
                        raise OSError(f"{path}: short read at {offset}")
                    at, offset, length = at + got, offset + got, length - got
        finally:
            os.close(fd)
    return buffer


def merge_then_shard(ckpt: Path, args: ModelArgs, rank: int, tp: int) -> Transformer:
    """Rank 0 builds the whole state dict from every file, then hands each rank its slice."""
    expected = full_shapes(args)
    full_state: dict[str, torch.Tensor] = {}
    if rank == 0:
        paths = find_shards(ckpt)
        shards = [torch.load(p, map_location="cpu", weights_only=True) for p in paths]
        for key, full in expected.items():
            split = source_split_dim(key, full, tuple(shards[0][key].shape), len(paths), paths[0])
            full_state[key] = shards[0][key] if split is None else torch.cat([s[key] for s in shards], dim=split)
        del shards
    with torch.device("meta"):
        model = Transformer(args)
    if tp == 1:
        model.load_state_dict(full_state, strict=True, assign=True)
        return model
    mesh = make_mesh(torch.device("cpu"), tp)
    apply_tensor_parallel(model, mesh)
    state: dict[str, torch.Tensor] = {}
    for key, full in expected.items():
        dim = shard_dim(key, args.family)
        if dim is None:
            local = full_state[key] if rank == 0 else torch.empty(full, dtype=DTYPE)
            dist.broadcast(local, src=0)
            state[key] = local
            continue
        box = local_box(full, dim, rank, tp)
        local = torch.empty([hi - lo for lo, hi in box], dtype=DTYPE)
        pieces = [p.contiguous() for p in full_state.pop(key).chunk(tp, dim)] if rank == 0 else None
        dist.scatter(local, pieces, src=0)
        state[key] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def reset_peak_rss() -> float:
    """Restart the kernel's peak-RSS counter (VmHWM), so one process can measure several loads."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status_mb("VmRSS")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(method: str, ckpt: Path, args: ModelArgs, info: DistInfo, keep: list) -> dict:
    """One cold load on this rank, timed from a barrier; memory counted above what the rank held before.

    The loaded model goes into `keep`: freeing a tensor-parallel model mid-run drops its device
    mesh's gloo groups, which intermittently aborts the process ("terminate called without an
    active exception"), so nothing is freed until the worker exits.
    """
    rank, tp = info.rank, info.world_size
    plan = plan_reads(ckpt, args, rank, tp) if method == "floor" else {}
    dist.barrier()
    if rank == 0:
        drop_file_cache(find_shards(ckpt))
    dist.barrier()
    rss_before = reset_peak_rss()
    bytes_before, started = read_bytes(), time.perf_counter()
    try:
        if method == "floor":
            loaded: object = read_plan(plan)
        elif method.startswith("direct"):  # as Engine.load does: each block prepared as it is read
            quantized = method.partition("-")[2] or "none"
            loaded = load_tp_model(ckpt, args, info, DTYPE,
                                   backend.preparation_for(info.device, DTYPE, quantized=quantized))
        elif method == "seed":
            loaded = load_fsdp_model(ckpt, args, info, DTYPE)
        else:
            loaded = merge_then_shard(ckpt, args, rank, tp)
    except Exception as exc:  # a failing path is a result too; the table shows why
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split()[:60])}"}
    keep.append(loaded)
    return {
        "wall_s": time.perf_counter() - started,
        "read_bytes": read_bytes() - bytes_before,
        "extra_rss_mb": _status_mb("VmHWM") - rss_before,
    }


def worker(methods: list[str], ckpt: Path) -> None:
    """Every method in turn on this rank; rank 0 prints all ranks' numbers as one JSON line."""
    info = init_distributed(require_group=True)
    rank, tp = info.rank, info.world_size
    args = read_params(ckpt)
    # The seed and merge paths (FSDP, parallelize_module) import torch._dynamo lazily, as did the
    # direct path before it built local modules: a one-time cost of the process that would land on
    # whichever method ran first, so it is paid here, outside every method's numbers.
    started = time.perf_counter()
    import torch._dynamo  # noqa: F401
    mine = {"rank": rank, "empty_rss_mb": _status_mb("VmRSS"), "share_bytes": share_bytes(args, tp),
            "dynamo_import_s": time.perf_counter() - started}
    keep: list = []
    mine["methods"] = {method: measure(method, ckpt, args, info, keep) for method in methods}
    ranks: list[dict | None] = [None] * tp
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        print(json.dumps({"ranks": ranks}), flush=True)
    dist.barrier()
    os._exit(0)  # the numbers are out; skip tearing down the kept models and their groups


def summarize(runs: list[dict], method: str) -> dict:
    """Median over repeats of each rank's numbers; the load is done when the slowest rank is."""
    per_rank = []
    for r in range(len(runs[0]["ranks"])):
        samples = [run["ranks"][r]["methods"][method] for run in runs if method in run["ranks"][r]["methods"]]
        errors = [s["error"] for s in samples if "error" in s]
        if errors:
            return {"error": errors[0]}
        per_rank.append({k: statistics.median(s[k] for s in samples) for k in samples[0]})
    return {
        "wall_s": max(r["wall_s"] for r in per_rank),
        "read_mb": sum(r["read_bytes"] for r in per_rank) / 1e6,
        "extra_rss_mb": max(r["extra_rss_mb"] for r in per_rank),
        "ranks": per_rank,
        "samples": [[rank["methods"][method]["wall_s"] for rank in run["ranks"]]
                    for run in runs if method in run["ranks"][0]["methods"]],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b-half")
    parser.add_argument("--pairs", nargs="+", default=["1:1", "2:2", "4:2", "1:2"], help="MP:TP")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="floor is always run: the other methods are reported against it")
    parser.add_argument("--repo", type=Path, help="run the ranks from this checkout's code (default: this one)")
    parser.add_argument("--out", default="load", help="name of the JSON under bench/out (default: load)")
    parser.add_argument("--worker", nargs="+", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.worker:
        worker(a.worker, a.ckpt)
        return

    root = a.repo.resolve() if a.repo else REPO
    module = module_in(root, "bench.engine.load", "bench.bench_load")  # the ranks' code
    results = []
    for pair in a.pairs:
        mp, tp = (int(x) for x in pair.split(":"))
        ckpt = ensure_checkpoint(PRESETS[a.preset], mp)
        runs = []
        for repeat in range(a.repeats):
            # The seed path is an order of magnitude slower: one sample is enough for its ratio.
            methods = [m for m in METHODS if (m == "floor" or m in a.methods)
                       and (m != "seed" or (repeat == 0 and tp % mp == 0))]
            # A different method goes first each time, so drifting disk speed hits them alike.
            methods = methods[repeat % len(methods):] + methods[: repeat % len(methods)]
            command = ["--worker", *methods, "--ckpt", str(ckpt)]
            runs.append(last_json(torchrun(module, command, tp, timeout=600, env=FRESH_MALLOC, repo=root)))
        first = runs[0]["ranks"]
        summary = {m: summarize(runs, m) for m in METHODS if m in first[0]["methods"]}
        results.append({
            "mp": mp, "tp": tp, "ckpt": str(ckpt),
            "empty_rss_mb": max(r["empty_rss_mb"] for r in first),
            "share_mb": max(r["share_bytes"] for r in first) / 1e6,
            "dynamo_import_s": statistics.median(r["dynamo_import_s"] for run in runs for r in run["ranks"]),
            "methods": summary,
        })
        print(f"MP {mp} -> TP {tp}: " + ", ".join(
            f"{m} {s['wall_s']:.2f} s" if "wall_s" in s else f"{m} failed" for m, s in summary.items()), flush=True)
    data = {"preset": a.preset, "dtype": str(DTYPE), "cache": "cold (posix_fadvise DONTNEED before each load)",
            "repeats": a.repeats, "repo": str(a.repo.resolve()) if a.repo else None, "results": results}
    path = write_json(a.out, data)
    print(report(data))
    print(f"raw numbers: {path}")


def report(data: dict) -> str:
    """The loading table and its notes, from the JSON (printed here and pasted by bench.report)."""
    rows = []
    for res in data["results"]:
        pair = f"{res['mp']} -> {res['tp']}"
        floor = res["methods"]["floor"]
        for method, s in res["methods"].items():
            if "error" in s:
                rows.append([pair, method, "failed", "-", "-", "-", "-"])
                continue
            rows.append([
                pair, method, s["wall_s"], s["wall_s"] / floor["wall_s"], s["read_mb"],
                res["empty_rss_mb"] + s["extra_rss_mb"], s["extra_rss_mb"] / res["share_mb"],
            ])
    headers = ["MP -> TP", "method", "wall s (slowest rank)", "x floor", "MB read (all ranks)",
               "peak RSS MB (largest rank)", "(peak - empty) / share"]
    notes = [f"- MP {r['mp']} -> TP {r['tp']}: an empty rank holds {r['empty_rss_mb']:.0f} MB; each rank's share of "
             f"the weights is {r['share_mb']:.0f} MB. Not in the wall times: the process's one-time import of "
             f"torch._dynamo ({r['dynamo_import_s']:.2f} s), which the seed and merge paths trigger (and the direct path did "
             f"before it built local modules without DTensor)."
             for r in data["results"]]
    notes += [f"- {r['mp']} -> {r['tp']} {m} failed: {s['error'][:400]}"
              for r in data["results"] for m, s in r["methods"].items() if "error" in s]
    return table(headers, rows) + "\n\n" + "\n".join(notes)


def targets(data: dict) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for the direct loader on every MP -> TP pair."""
    out = []
    for res in data["results"]:
        direct, floor = res["methods"]["direct"], res["methods"]["floor"]
        pair = f"MP {res['mp']} -> TP {res['tp']}"
        speed = direct["wall_s"] / floor["wall_s"]
        memory = direct["extra_rss_mb"] / res["share_mb"]
        out.append((f"load {pair}: direct within 1.5x of the floor", f"{speed:.2f}x", speed <= 1.5))
        out.append((f"load {pair}: peak memory within 1.2x of share + empty", f"{memory:.2f}x", memory <= 1.2))
    return out


if __name__ == "__main__":
    main()
