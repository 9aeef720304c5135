"""The one thread that loads a worker rank's engine and runs its steps, so that steps can go on between
TorchServe's calls.

While the frontend carries a call's replies out and the next call in (a round trip of a few ms, with the
worker's main thread in TorchServe's socket loop), the engine would sit idle; a thread of its own keeps
stepping meanwhile (handler.step_between_calls). Everything the engine computes runs on this one thread,
its load included, so a rank has a single OpenMP team: the runtime keeps a team for every thread that
starts parallel regions, and with more teams than cores libgomp cuts its threads' spinning short, so they
sleep at every barrier of a step (docs/perf-log/2026-11-30.md, ninth session). Loading here also makes
init_distributed's CUDA device this thread's, the one CUDA keeps per thread.

A new thread's OpenMP team size starts from the environment's OMP_NUM_THREADS (TorchServe exports 1), not
from what the main thread chose, so it takes the main thread's when it starts. It is a daemon: a rank
stopping never waits for a step of its peers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch


class StepThread:
    """A single daemon thread running submitted calls in order, each with a Future of its result; and the
    steps a rank runs there between two calls."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._between: Future | None = None  # the steps begun since the last call answered
        self._call_arrived = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(torch.get_num_threads(),), name="engine-steps",
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

    def start_between_calls(self, fn: Callable[..., Any], *args: Any) -> None:
        """fn(*args) begun once a call has answered: steps that end when `call_arrived` says so (or sooner)."""
        self._between = self.submit(fn, *args)

    def call_arrived(self) -> bool:
        """Whether the next call waits for the steps between calls to end."""
        return self._call_arrived.is_set()

    def end_between_calls(self) -> None:
        """The steps between calls end after the one in progress (they read `call_arrived`), waited for."""
        if self._between is None:
            return
        self._call_arrived.set()
        try:
            self._between.result()
        finally:
            self._between = None
            self._call_arrived.clear()

    def _serve(self, threads: int) -> None:
        torch.set_num_threads(threads)  # this thread's own OpenMP team, the C kernels' too
        while True:
            future, fn, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiting caller, never lost with the thread
                future.set_exception(exc)
