"""The one thread that runs a worker rank's engine steps, so that steps can go on between TorchServe's calls.

While the frontend carries a call's replies out and the next call in (a round trip of a few ms, with the
worker's main thread in TorchServe's socket loop), the engine would sit idle; a thread of its own keeps
stepping meanwhile (handler.step_between_calls). Every step of the rank runs on this one thread, the
handler's calls included, so a single OpenMP team serves them all: an OpenMP runtime keeps a team per
thread that starts parallel regions, and two would take turns spinning on the same cores.

A new thread starts from the OpenMP thread count of the environment (TorchServe exports
OMP_NUM_THREADS=1) and from CUDA device 0, not from what the main thread chose, so it takes both from
the main thread when it starts. It is a daemon: a rank stopping never waits for a step of its peers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch


class StepThread:
    """A single daemon thread running submitted calls in order, each with a Future of its result."""

    def __init__(self, device: torch.device) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._serve, args=(threads, device), name="engine-steps",
                                        daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """fn(*args) on the step thread after every call submitted before it."""
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the step thread, waited for: its result, or its exception raised here."""
        return self.submit(fn, *args).result()

    def _serve(self, threads: int, device: torch.device) -> None:
        torch.set_num_threads(threads)  # this thread's own OpenMP team, the C kernels' too
        if device.type == "cuda":
            torch.cuda.set_device(device)
        while True:
            future, fn, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiting caller, never lost with the thread
                future.set_exception(exc)
