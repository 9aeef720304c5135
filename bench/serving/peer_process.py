"""A peer server (vLLM, llama-server) as a child process on loopback: start it, wait for its /health,
read its log, stop its whole process group."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import time
from pathlib import Path


class PeerProcess:
    """Subclasses set `name`, `command`, `log_path`, `port` (and maybe `env`, `poll_s`); use as a
    context manager, which stops the server."""

    name = "server"
    poll_s = 0.5

    def __init__(self, port: int, workdir: Path, log_name: str) -> None:
        self.port, self.workdir = port, workdir
        self.log_path = workdir / log_name
        self.command: list[str] = []
        self.env: dict[str, str] | None = None
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write((" ".join(self.command) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(self.command, cwd=self.workdir, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        """Seconds until GET /health answers 200."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}\n{self.log_tail()}")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(self.poll_s)
        raise TimeoutError(f"{self.name} not ready after {timeout} s\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM to the server's own process group (start_new_session), SIGKILL at the deadline, and
        to any child that outlived it (vLLM's engine core)."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        pgid = self.process.pid
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait()
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.process.returncode
