"""Fault injection for the reliability tests: one rank fails at a chosen point of a live server.

Nothing of it runs in the product. `install` wraps three functions where the product calls them:
reading params.json while loading ("load"), the seed converter's unshard of each split tensor
("convert") and each rank's step ("decode"). A process gets it from the sitecustomize.py in
fault_site/ beside this file, which tests put on PYTHONPATH with TP_LLAMA_FAULT_FILE naming a
file. That file is read again at every fault point, so writing or deleting it changes the next
attempt: a JSON list of {"point": "load" | "convert" | "decode", "kind": "exception" | "oom" |
"exit" | "hang" | "delay", "rank": N (all ranks when absent), "seconds": S (delay only)}.
"delay" only slows the point down, so a test can keep a request in flight on any machine.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

FAULT_FILE_ENV = "TP_LLAMA_FAULT_FILE"
SITE = Path(__file__).with_name("fault_site")  # put on PYTHONPATH to install the faults at start-up
POINTS = ("load", "convert", "decode")
KINDS = ("exception", "oom", "exit", "hang", "delay")


class InjectedFault(RuntimeError):
    """Raised by kind "exception"; the message says it was injected, so nobody chases it as a bug."""


def fault_env(fault_file: str | os.PathLike) -> dict[str, str]:
    """The environment that gives a process (and every process it starts) the faults of this file."""
    path = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))
    return {FAULT_FILE_ENV: str(fault_file), "PYTHONPATH": path}


def _faults() -> list[dict]:
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return []
    try:
        with open(path) as f:
            faults = json.load(f)
    except FileNotFoundError:
        return []
    for fault in faults:
        if fault.get("point") not in POINTS or fault.get("kind") not in KINDS:
            raise ValueError(f"{path}: bad fault {fault}; point in {POINTS}, kind in {KINDS}")
    return faults


def inject_fault(point: str) -> None:
    """Fire the fault configured for this point and this process's rank, if any."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    for fault in _faults():
        if fault["point"] != point or fault.get("rank", rank) != rank:
            continue
        kind = fault["kind"]
        where = f"{point} on rank {rank}"
        if kind == "exception":
            raise InjectedFault(f"injected fault at {where}")
        if kind == "oom":
            # A real allocation failure from the device's allocator, as a too-large model gives.
            torch.empty(1 << 60, dtype=torch.uint8, device="cuda" if torch.cuda.is_initialized() else "cpu")
        if kind == "exit":
            os.write(2, f"[tp_llama rank {rank}] injected fault: process exits at {where}\n".encode())
            os._exit(43)
        if kind == "delay":
            time.sleep(float(fault.get("seconds", 0.05)))
        if kind == "hang":
            os.write(2, f"[tp_llama rank {rank}] injected fault: hanging at {where}\n".encode())
            while True:
                time.sleep(60)


def _at(point: str, function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        inject_fault(point)
        return function(*args, **kwargs)

    return wrapped


def install() -> None:
    """Wrap the fault points of this process's tp_llama."""
    from tp_llama.engine import core, runner
    from tp_llama.parallel import converter

    core.read_params = _at("load", core.read_params)
    converter._unshard_param = _at("convert", converter._unshard_param)
    runner.ModelRunner.execute = _at("decode", runner.ModelRunner.execute)
