"""Servers taking turns on one machine: the CPU a server's process tree has used, and a wait until all
of them are quiet, so one server's leftover threads do not eat into the next one's turn.

The same measures as bench/serving/levels.py's (which keeps its own copy for now).
"""

from __future__ import annotations

import contextlib
import subprocess
import time

import psutil


def cpu_seconds(process: subprocess.Popen | None) -> float:
    """User and system CPU seconds of a server's process tree so far (its live processes')."""
    if process is None:
        return 0.0
    try:
        root = psutil.Process(process.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def settle(processes: list[subprocess.Popen | None], quiet_cpu_s: float = 0.02, window_s: float = 0.5,
           timeout_s: float = 30.0) -> float:
    """Seconds until the servers together use under quiet_cpu_s of CPU in window_s: a server's threads
    can spin on for a second after its turn (vLLM's OpenMP), eating into the next server's."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        before = sum(cpu_seconds(p) for p in processes)
        time.sleep(window_s)
        if sum(cpu_seconds(p) for p in processes) - before < quiet_cpu_s:
            break
    return time.monotonic() - started
