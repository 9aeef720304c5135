"""How many CPU threads each rank of a worker computes with.

TorchServe exports OMP_NUM_THREADS=1 to every worker unless the yaml's `torchrun.OMP_NUMBER_THREADS`
says otherwise, so a worker left at that default computes on one core per rank however many the host
has. When the key is absent from the yaml, the handler takes the cores this process may really use
(its CPU affinity, capped by a cgroup CPU quota as a container's `--cpus` sets it) and shares them
between the ranks of this node: each rank gets usable // ranks threads, at least 1. A quota of 1.5
CPUs counts as 1: an OpenMP team larger than the quota waits at every barrier for a throttled thread.
An explicit value always wins. The C kernels and PyTorch share one OpenMP runtime (torch's libgomp),
so torch.set_num_threads sizes both.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
KEY = "OMP_NUMBER_THREADS"  # TorchServe's name for it under `torchrun:`


@dataclass(frozen=True)
class ThreadChoice:
    """The threads of one rank and why, for the load's log line."""

    threads: int
    why: str

    def log_line(self) -> str:
        return f"CPU threads: {self.threads} per rank ({self.why})"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _quota_v2(folder: Path) -> float | None:
    """cgroup v2's cpu.max, "QUOTA PERIOD" or "max PERIOD", as CPUs."""
    text = _read(folder / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return int(quota) / int(period)


def _quota_v1(folder: Path) -> float | None:
    """cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us as CPUs (-1: no quota)."""
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _ancestors(base: Path, path: str) -> list[Path]:
    """base/path and each of its parents up to base itself (a container sees only its own part)."""
    parts = [part for part in path.split("/") if part]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, self_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The CPUs this process's cgroup quota allows, the tightest quota on its path; None without one.

    Reads cgroup v2 (`cpu.max`) and v1 (`cpu.cfs_quota_us` over `cpu.cfs_period_us`), from the
    process's own cgroup (/proc/self/cgroup) up to the root of the mount.
    """
    limits: list[float] = []
    lines = (_read(self_cgroup) or "0::/").splitlines()
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            folders, read = _ancestors(root, path), _quota_v2
        elif "cpu" in controllers.split(","):
            mounts = {root / controllers, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"}
            folders = [f for mount in sorted(mounts) for f in _ancestors(mount, path)]
            read = _quota_v1
        else:
            continue
        limits += [cpus for folder in folders if (cpus := read(folder)) is not None]
    return min(limits) if limits else None


def affinity_cpus() -> Collection[int]:
    """The CPUs this process may run on (all of them where the OS cannot say)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return range(os.cpu_count() or 1)


def usable_cpus(affinity: Collection[int], quota: float | None) -> int:
    """Cores this process may keep busy: its affinity mask, capped by a cgroup quota (rounded down)."""
    cpus = max(1, len(affinity))
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return cpus


def threads_per_rank(affinity: Collection[int], quota: float | None, ranks: int) -> int:
    """The usable cores shared between this node's ranks, at least 1 each."""
    return max(1, usable_cpus(affinity, quota) // max(1, ranks))


def choose_threads(torchrun: Mapping[str, Any] | None, *, affinity: Collection[int] | None = None,
                   quota: float | None = None, ranks: int | None = None, read_cgroup: bool = True) -> ThreadChoice:
    """The threads of this rank: `torchrun.OMP_NUMBER_THREADS` when the yaml sets it, else its share
    of the usable cores. Unset arguments are read from this process (affinity, the cgroup quota unless
    read_cgroup is false, LOCAL_WORLD_SIZE or the yaml's nproc-per-node)."""
    torchrun = torchrun or {}
    affinity = affinity_cpus() if affinity is None else affinity
    if quota is None and read_cgroup:
        quota = cgroup_cpu_limit()
    if ranks is None:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or torchrun.get("nproc-per-node") or 1)
    usable = usable_cpus(affinity, quota)
    cap = f"affinity {len(affinity)}" + (f", cgroup quota {quota:g}" if quota is not None else "")
    if KEY in torchrun:
        threads = int(torchrun[KEY])
        why = f"torchrun.{KEY}: {threads}"
        if threads * ranks > usable:
            why += f"; {ranks} ranks x {threads} threads exceed the {usable} usable CPUs ({cap})"
        return ThreadChoice(threads, why)
    threads = threads_per_rank(affinity, quota, ranks)
    return ThreadChoice(threads, f"torchrun.{KEY} unset: {usable} usable CPUs ({cap}) / {ranks} "
                                 f"rank{'s' if ranks != 1 else ''} on this node")
