"""Run `tp_llama.generate` alone or as a group of ranks, with a hard deadline that kills them all.

A group's ranks are started here as torchrun starts its workers, without torchrun's own process:
each rank in a session of its own with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, rank 0 holding the store; the TORCHELASTIC_*
variables), all writing to the same stdout and stderr, and when one rank fails the others get
SIGTERM, then SIGKILL 30 s later, the run's status 1. torchrun itself imports torch before any rank
starts: 3-4 s a run on 2 cores, half of a failing run, for nothing the product reads. torchrun
still launches every TorchServe worker and tests/test_serving_e2e.py's CLI references.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

from tests.support.dist_util import free_port

TERM_GRACE_S = 30.0  # torchrun's wait between SIGTERM and SIGKILL for the ranks left when one fails


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def launch_cli(cli_args: list[str], world: int, timeout: float = 120.0, env: dict | None = None) -> CliRun:
    """Ranks of a world over 1 run on CPU (gloo) unless the args name a device: a test machine's one GPU
    cannot take two NCCL ranks."""
    if world > 1 and "--device" not in cli_args:
        cli_args = [*cli_args, "--device", "cpu"]
    command = [sys.executable, "-m", "tp_llama.generate", *cli_args]
    full_env = {**os.environ, "TP_LLAMA_COLLECTIVE_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1", **(env or {})}
    started = time.monotonic()
    if world == 1:
        returncode, stdout, stderr = _run_one(command, full_env, timeout)
    else:
        returncode, stdout, stderr = _run_group(command, world, full_env, timeout)
    return CliRun(returncode, stdout, stderr, time.monotonic() - started)


def _run_one(command: list[str], env: dict, timeout: float) -> tuple[int, str, str]:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session: the process and anything it started
        stdout, stderr = proc.communicate()
        raise TimeoutError(f"CLI ran past {timeout} s: {' '.join(command)}\n{stderr[-3000:]}")
    except BaseException:  # Ctrl-C: take the process down with the test
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, stdout, stderr


def rank_env(env: dict, rank: int, world: int, port: int, run_id: str) -> dict:
    """The environment torchrun's agent gives rank `rank` of a one-node world (its local_elastic_agent),
    the rendezvous store held by rank 0 rather than by the agent."""
    return {
        **env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(world), "WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def _run_group(command: list[str], world: int, env: dict, timeout: float) -> tuple[int, str, str]:
    """`world` ranks of `command` sharing one stdout and one stderr pipe, as torchrun's workers share its own."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    chunks: dict[int, list[bytes]] = {out_read: [], err_read: []}

    def drain(fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            while block := pipe.read1(65536):
                chunks[fd].append(block)

    readers = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in (out_read, err_read)]
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world):
            procs.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out_write, stderr=err_write,
                                          env=rank_env(env, rank, world, port, run_id), start_new_session=True))
    except BaseException:
        _signal_all(procs, signal.SIGKILL)
        raise
    finally:
        os.close(out_write)
        os.close(err_write)
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    failed = False
    try:
        while any(proc.poll() is None for proc in procs):
            if not failed and any(proc.returncode not in (None, 0) for proc in procs):
                failed = True  # torchrun stops the others at a rank's failure, then kills what is left
                _signal_all(procs, signal.SIGTERM)
                deadline = min(deadline, time.monotonic() + TERM_GRACE_S)
            if time.monotonic() > deadline:
                _signal_all(procs, signal.SIGKILL)
                for proc in procs:
                    proc.wait(timeout=10)
                if not failed:
                    raise TimeoutError(f"CLI ran past {timeout} s on {world} ranks: {' '.join(command)}\n"
                                       f"{_text(chunks[err_read])[-3000:]}")
                break
            time.sleep(0.05)
    except BaseException:  # Ctrl-C or the timeout: take every rank down with the test
        _signal_all(procs, signal.SIGKILL)
        raise
    for reader in readers:
        reader.join(timeout=10)
    status = 0 if all(proc.returncode == 0 for proc in procs) else 1
    return status, _text(chunks[out_read]), _text(chunks[err_read])


def _signal_all(procs: list[subprocess.Popen], sig: signal.Signals) -> None:
    """`sig` to each rank's session (the rank and whatever it started), as torchrun's close does: SIGTERM
    to the ranks still running, SIGKILL to every session left."""
    for proc in procs:
        if sig == signal.SIGKILL or proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _text(blocks: list[bytes]) -> str:
    return b"".join(blocks).decode(errors="replace")
