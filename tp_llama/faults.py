"""Fault injection, a test hook that is off unless TP_LLAMA_FAULT_FILE names a file.

The reliability tests use it to make one rank fail at a chosen point of a live server, then
take the fault away and watch TorchServe's worker restart bring the model back. The file is
read again at every fault point, so writing or deleting it changes the next attempt. It holds
a JSON list of faults: {"point": "load" | "convert" | "decode", "kind": "exception" | "oom" |
"exit" | "hang" | "delay", "rank": N (all ranks when absent), "seconds": S (delay only)}.
"delay" only slows the point down, so a test can keep a request in flight on any machine.
"""

from __future__ import annotations

import json
import os
import time

import torch

FAULT_FILE_ENV = "TP_LLAMA_FAULT_FILE"
POINTS = ("load", "convert", "decode")
KINDS = ("exception", "oom", "exit", "hang", "delay")


class InjectedFault(RuntimeError):
    """Raised by kind "exception"; the message says it was injected, so nobody chases it as a bug."""


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


def inject_fault(point: str, rank: int, device: torch.device) -> None:
    """Fire the fault configured for this point and rank, if any."""
    for fault in _faults():
        if fault["point"] != point or fault.get("rank", rank) != rank:
            continue
        kind = fault["kind"]
        where = f"{point} on rank {rank}"
        if kind == "exception":
            raise InjectedFault(f"injected fault at {where}")
        if kind == "oom":
            # A real allocation failure from the device's allocator, as a too-large model gives.
            torch.empty(1 << 60, dtype=torch.uint8, device=device)
        if kind == "exit":
            os.write(2, f"[tp_llama rank {rank}] injected fault: process exits at {where}\n".encode())
            os._exit(43)
        if kind == "delay":
            time.sleep(float(fault.get("seconds", 0.05)))
        if kind == "hang":
            os.write(2, f"[tp_llama rank {rank}] injected fault: hanging at {where}\n".encode())
            while True:
                time.sleep(60)
