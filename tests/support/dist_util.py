"""Run a function on N gloo ranks in processes of their own, with a hard deadline."""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks fork from a server that has imported these once per test process; a spawned rank paid
# torch's import, most of a small test's CPU, every time (docs/tests.md).
PRELOAD = ["torch.distributed", "tp_llama.engine.core", "tests.support.dist_util"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn, rank: int, world_size: int, port: int, results, env: dict[str, str], args) -> None:
    os.environ.clear()  # the server's environment is its start's: the caller's is the one that counts
    os.environ.update(
        env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 90.0) -> list:
    """fn(*args) on every rank; returns the per-rank results or raises with every rank's traceback."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, results, env, args))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
                outcome[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            # A rank killed by a signal never reports; don't wait for it until the deadline.
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcome]
            if dead:
                raise AssertionError(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(outcome))} did not finish in {timeout} s")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    failures = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(outcome.items()) if not ok]
    if failures:
        raise AssertionError("\n".join(failures))
    return [outcome[r][1] for r in range(world_size)]
