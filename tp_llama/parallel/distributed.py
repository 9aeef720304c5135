"""Process group, device choice and the few collectives the engine needs, all with timeouts."""

from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from tp_llama.errors import CheckpointError
from tp_llama.model.batch import to_device

# Every collective gives up after this long, so a dead or failed rank never hangs the group.
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def collective_timeout() -> timedelta:
    """TP_LLAMA_COLLECTIVE_TIMEOUT_S seconds, DEFAULT_TIMEOUT_S when unset or empty (as the other
    TP_LLAMA_* variables); anything but a number above 0 stops the rank naming the variable, rather
    than float()'s bare message or a timeout that fails every collective at once."""
    raw = os.environ.get("TP_LLAMA_COLLECTIVE_TIMEOUT_S", "").strip()
    if not raw:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"TP_LLAMA_COLLECTIVE_TIMEOUT_S={raw!r}: a number of seconds above 0, e.g. 600")
    return timedelta(seconds=seconds)


def pick_device(wanted: str, local_rank: int, local_world_size: int, gpus: int | None = None) -> torch.device:
    """The device of this rank: "cpu", "cuda", or "auto" (CUDA when this process sees a GPU).

    One GPU per rank (NCCL refuses two ranks on one GPU), so a node with more ranks than visible
    GPUs is refused here, before any collective, with what to change.
    """
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if wanted == "cpu" or (wanted == "auto" and gpus == 0):
        return torch.device("cpu")
    if gpus == 0:
        raise RuntimeError("deviceType asks for GPUs, but this process sees none "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    if local_world_size > gpus:
        raise RuntimeError(
            f"{local_world_size} ranks on this node but {gpus} GPU(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): NCCL needs one GPU per rank; "
            f"set torchrun.nproc-per-node to at most {gpus}, or deviceType: cpu")
    return torch.device("cuda", local_rank)


def die_with_launcher() -> None:
    """Have Linux SIGKILL this rank when its launcher (torchrun) dies.

    TorchServe restarts a worker by killing torchrun outright; its ranks would otherwise live
    on as orphans, holding the model's memory, and a rank stuck in a collective never exits.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the launcher was already gone before the request took effect
        os._exit(1)


def init_distributed(device_type: str = "auto", require_group: bool = False) -> DistInfo:
    """Join torchrun's process group (nccl on CUDA, gloo on CPU), or run alone without torchrun.

    device_type: "auto", "cpu" or "cuda" (pick_device). A lone process gets a one-rank group only
    when asked (the FSDP path needs one).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_type, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    launched = int(os.environ.get("WORLD_SIZE", 1)) > 1 or "MASTER_ADDR" in os.environ
    if launched:
        die_with_launcher()
    if not dist.is_initialized() and (launched or require_group):
        backend = "nccl" if device.type == "cuda" else "gloo"
        device_id = device if device.type == "cuda" else None
        if launched:
            dist.init_process_group(backend, timeout=collective_timeout(), device_id=device_id)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=collective_timeout(), device_id=device_id
            )
    if not dist.is_initialized():
        return DistInfo(0, 1, 0, device, "none")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())


def log(message: str, rank: int | None = None) -> None:
    """Progress goes to stderr (stdout is the CLI's JSON), tagged with the rank."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    # One write() per line: ranks share the launcher's stderr pipe and must not interleave.
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), f"[tp_llama rank {rank}] {message}\n".encode())


@contextmanager
def every_rank_agrees(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the block on every rank, then meet: if the block raised on any rank, every rank raises
    (a CheckpointError where each failure was one, naming each rank's cause); else all go on.

        with every_rank_agrees():
            state = read_my_slices()   # a file only this rank reads may be missing

    A rank that failed alone would otherwise leave the others waiting in their next collective
    until its timeout. Every rank must enter the block at the same point.
    """
    error = None
    try:
        yield
    except Exception as exc:  # forwarded to every rank below
        error = exc
    _raise_if_any_rank_failed(error, group)


def _raise_if_any_rank_failed(error: BaseException | None, group: dist.ProcessGroup | None = None) -> None:
    """every_rank_agrees' meeting: each rank's error (or None) gathered, every rank raising if any failed."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, message, group=group)
    failed = [(rank, msg) for rank, msg in enumerate(messages) if msg is not None]
    if not failed:
        return
    summary = "; ".join(f"rank {rank}: {msg}" for rank, msg in failed)
    all_checkpoint = all(msg.startswith(CheckpointError.__name__) for _, msg in failed)
    shared = (CheckpointError if all_checkpoint else RuntimeError)(summary)
    shared.every_rank = True  # see leave_group
    raise shared from error


def leave_group(error: BaseException | None) -> None:
    """Shut this rank's process group down after a run, successful or not.

    Ranks that fail together (every_rank_agrees) or finish together meet at a barrier
    first, so no rank tears the group down under another. A rank that failed alone leaves at
    once without any teardown: its peers are inside a collective it will never join, and its
    exit closes their connections so they fail now rather than at the collective timeout.
    """
    if not dist.is_initialized():
        return
    if error is not None and not getattr(error, "every_rank", False) and dist.get_world_size() > 1:
        exit_now(2)
    wait_for_peers()
    dist.destroy_process_group()


def exit_now(status: int) -> NoReturn:
    """End the process without tearing the process group down (peers may be mid-collective)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def broadcast_from_rank0(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Make every rank use rank 0's values (the step plan), so ranks can never drift apart."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    if dist.get_rank() == 0:  # it has them: no copy back, and none that blocks on the way out
        dist.broadcast(to_device(values, device), src=0)
        return values
    on_device = values.to(device)
    dist.broadcast(on_device, src=0)
    return on_device.to(values.device)


def object_from_rank0(value: object) -> object:
    """Rank 0's picklable `value` on every rank (the others pass None): rare control messages, never a step's."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def smallest_across_ranks(value: int, device: torch.device) -> int:
    """The least of every rank's `value` (each rank calls this at the same point)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def wait_for_peers(seconds: float = 10.0) -> None:
    """Best-effort barrier before a failing exit, so no rank is killed by the launcher mid-report."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=seconds))
        else:
            dist.barrier()
    except RuntimeError:
        pass
