"""Run `tp_llama.generate` alone or under torchrun, with a hard deadline that kills the whole tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass


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
    cli = ["-m", "tp_llama.generate", *cli_args]
    if world == 1:
        command = [sys.executable, *cli]
    else:
        # Port 0: the c10d store picks a free port, so concurrent runs never collide.
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", *cli]
    full_env = {**os.environ, "TP_LLAMA_COLLECTIVE_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1", **(env or {})}
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session: torchrun and every worker
        stdout, stderr = proc.communicate()
        raise TimeoutError(f"CLI ran past {timeout} s: {' '.join(command)}\n{stderr[-3000:]}")
    except BaseException:  # Ctrl-C: take the launched workers down with the test
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return CliRun(proc.returncode, stdout, stderr, time.monotonic() - started)
