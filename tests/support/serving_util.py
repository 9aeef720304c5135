"""A real TorchServe on loopback for tests: start, query, stop, and always clean up.

Everything the server writes (pid file, worker sockets, key_file.json, logs) goes under its
own work folder, and every port is a fresh free one, so the test never collides with another
TorchServe on the machine (including a demo started by setup_model.sh). The config comes from
deploy/server_config.py, as setup_model.sh's does: loopback only, token authorization on, the
management API on a unix socket in the work folder unless `management=True` asks for a port.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from deploy.make_archive import build_archive
from deploy.server_config import UNIX_PATH_MAX, connection, read_properties, write_config

VENV_BIN = Path(sys.executable).parent
ERROR_LINE = re.compile(r"error|Error|Exception|Traceback|\[tp_llama rank")
FINISH_LINE = re.compile(
    r"rank 0: request (\S+) (.+?) after (\d+) tokens; running (\d+)/(\d+), kv blocks used (\d+)/(\d+), waiting (\d+)")


def without_cache(reply: dict) -> dict:
    """A native reply less the prompt tokens the prefix cache supplied (a repeated prompt finds them cached)."""
    return {**reply, "usage": {k: v for k, v in reply["usage"].items() if k != "cached_prompt_tokens"}}


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (held open together so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _socket_path(preferred: Path) -> Path:
    """preferred, or a short path under /tmp when preferred is too long for a unix socket."""
    if len(os.fsencode(preferred.resolve())) <= UNIX_PATH_MAX:
        return preferred.resolve()
    return Path(tempfile.mkdtemp(prefix="ts-mgmt-")) / "management.sock"


def port_is_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


class TorchServe:
    """One TorchServe process tree serving MODEL_STORE/NAME; use as a context manager."""

    def __init__(
        self,
        workdir: Path,
        model_store: Path,
        name: str,
        *,
        management: bool = False,
        extra_config: Iterable[str] = (),
    ) -> None:
        """`management=True` puts the management API on a free 127.0.0.1 port with the model API on
        (setup_model.sh --management); by default it is on a unix socket, as setup_model.sh does.
        `extra_config`: further config.properties lines, e.g. "max_request_size=4096"."""
        self.workdir = workdir
        self.model_store = model_store
        self.name = name
        (self.inference_port, self.metrics_port, self.grpc_inference_port, self.grpc_management_port,
         worker_port, distribution_port, management_port) = free_ports(7)
        self.management_port: int | None = management_port if management else None
        self.management_socket: Path | None = None if management else _socket_path(workdir / "management.sock")
        self.tmp = workdir / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.config = write_config(
            workdir / "config.properties",
            model_store=Path(model_store).resolve(),
            inference_port=self.inference_port,
            metrics_port=self.metrics_port,
            grpc_inference_port=self.grpc_inference_port,
            grpc_management_port=self.grpc_management_port,
            management_socket=self.management_socket,
            management_port=self.management_port,
            extra=[
                f"initial_worker_port={worker_port}",
                f"initial_distribution_port={distribution_port}",
                "disable_system_metrics=true",
                *extra_config,
            ],
        )
        self.management_address = read_properties(self.config)["management_address"]
        self.env = dict(
            os.environ,
            PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            TMPDIR=str(self.tmp),
            TEMP=str(self.tmp),
        )
        self.process: subprocess.Popen | None = None
        self.tree: dict[int, psutil.Process] = {}
        self.log_path = workdir / "torchserve.out"

    def __enter__(self) -> TorchServe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        command = [
            str(VENV_BIN / "torchserve"), "--start", "--foreground", "--ncs",
            "--ts-config", str(self.config), "--model-store", str(self.model_store),
            "--models", f"{self.name}={self.name}",
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )

    def _remember_tree(self) -> None:
        """torchrun puts each rank in its own session, so the test tracks the tree by pid."""
        if self.process is None:
            return
        try:
            root = psutil.Process(self.process.pid)
            for proc in [root, *root.children(recursive=True)]:
                self.tree.setdefault(proc.pid, proc)
        except psutil.NoSuchProcess:
            pass

    def keys(self) -> dict[str, str]:
        data = json.loads((self.workdir / "key_file.json").read_text())
        return {"inference": data["inference"]["key"], "management": data["management"]["key"]}

    def wait_ready(self, timeout: float) -> float:
        """Seconds until the model's worker is READY; raises with the log tail on failure or timeout."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"torchserve exited with {self.process.returncode}\n{self.log_tail()}")
            if self.log_path.exists() and "Load model failed" in self.log_path.read_text(errors="replace"):
                raise RuntimeError(f"the worker failed to load the model\n{self.log_tail()}")
            self._remember_tree()
            if (self.workdir / "key_file.json").exists() and self._management_listening():
                try:
                    reply = self.management("GET", f"/models/{self.name}", timeout=10.0)
                    workers = reply.json()[0]["workers"] if reply.status == 200 else []
                except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException):
                    workers = []  # not listening yet, or key_file.json half written: ask again
                if any(w.get("status") == "READY" for w in workers):
                    self._remember_tree()
                    return time.monotonic() - started
            time.sleep(1.0)
        raise TimeoutError(f"model {self.name} not ready after {timeout} s\n{self.log_tail()}")

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str = "application/json",
        port: int | None = None,
        key: str | None = "inference",
        timeout: float = 120.0,
        headers: dict[str, str] | None = None,
        begun: threading.Event | None = None,
    ) -> Reply:
        """`begun` is set once the response's headers arrive (a continuous batch's reply begins at its
        request's first step)."""
        conn = http.client.HTTPConnection("127.0.0.1", port or self.inference_port, timeout=timeout)
        headers = {"Content-Type": content_type, **(headers or {})}
        if key is not None:
            headers["Authorization"] = f"Bearer {self.keys()[key]}"
        return _send(conn, method, path, body, headers, begun)

    def management(
        self, method: str, path: str, body: bytes | None = None, key: str | None = "management",
        timeout: float = 60.0,
    ) -> Reply:
        """A management API request, over the unix socket or the TCP port, whichever it is on."""
        conn = connection(self.management_address, timeout=timeout)
        headers = {} if key is None else {"Authorization": f"Bearer {self.keys()[key]}"}
        return _send(conn, method, path, body, headers)

    def _management_listening(self) -> bool:
        if self.management_port is not None:
            return port_is_open(self.management_port)
        return self.management_socket is not None and self.management_socket.is_socket()

    def predict(self, payload: dict | bytes, timeout: float = 120.0, content_type: str = "application/json",
                begun: threading.Event | None = None) -> Reply:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return self.request("POST", f"/predictions/{self.name}", body, content_type, timeout=timeout, begun=begun)

    def predict_stream(self, payload: dict, timeout: float = 120.0) -> tuple[int, list[dict]]:
        """POST with "stream": true; returns the status and the chunks, one JSON object per line."""
        conn = http.client.HTTPConnection("127.0.0.1", self.inference_port, timeout=timeout)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.keys()['inference']}"}
        try:
            conn.request("POST", f"/predictions/{self.name}", body=json.dumps(payload).encode(), headers=headers)
            response = conn.getresponse()
            chunks = [json.loads(line) for line in response.read().splitlines() if line.strip()]
            return response.status, chunks
        finally:
            conn.close()

    def log_tail(self, chars: int = 4000) -> str:
        """The frontend log's end plus the workers' error lines, which are easy to miss in the noise."""
        parts = []
        if self.log_path.exists():
            parts.append(f"--- {self.log_path.name} (end) ---\n{self.log_path.read_text(errors='replace')[-chars:]}")
        errors = [line for line in self.model_log().splitlines() if ERROR_LINE.search(line)]
        parts.append("--- model_log.log (error lines) ---\n" + "\n".join(errors[-40:]))
        return "\n".join(parts)

    def model_log(self) -> str:
        path = self.workdir / "logs" / "model_log.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def finishes(self) -> list[dict]:
        """Every request rank 0 has ended (answered, stopped or cancelled), with the sequences running
        and the KV-cache blocks in use after it."""
        return [
            {"id": m[1], "how": m[2], "tokens": int(m[3]), "busy": int(m[4]), "slots": int(m[5]),
             "blocks": int(m[6]), "blocks_total": int(m[7]), "waiting": int(m[8])}
            for m in FINISH_LINE.finditer(self.model_log())
        ]

    def wait_for_finishes(self, count: int, timeout: float = 20.0) -> list[dict]:
        """finishes() once it holds `count` requests, or as it stands at the deadline: the frontend
        writes the workers' log lines behind their replies."""
        deadline = time.monotonic() + timeout
        while len(ended := self.finishes()) < count and time.monotonic() < deadline:
            time.sleep(0.2)
        return ended

    def stop(self, timeout: float = 60.0) -> dict[str, object]:
        """torchserve --stop, then wait; anything of ours still alive afterwards is killed.

        Returns what happened, so a test can check that the stop was clean.
        """
        if self.process is None:
            return {"returncode": None, "leftover": []}
        self._remember_tree()
        try:
            subprocess.run(
                [str(VENV_BIN / "torchserve"), "--stop"], cwd=self.workdir, env=self.env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            pass  # the kills below still run
        try:
            returncode = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        deadline = time.monotonic() + timeout
        alive = [p for p in self.tree.values() if _alive(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.5)
            alive = [p for p in alive if _alive(p)]
        leftover = [p.pid for p in alive]
        for proc in alive:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        if returncode is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None
        return {"returncode": returncode, "leftover": leftover}


def _send(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None, headers: dict,
          begun: threading.Event | None = None) -> Reply:
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        if begun is not None:
            begun.set()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextmanager
def live_server(work: Path, checkpoint: Path, overrides: Iterable[str], *, tp: int = 2, startup_timeout: float = 240,
                extra_config: Iterable[str] = (), env: dict[str, str] | None = None,
                with_testing: bool = False) -> Iterator[TorchServe]:
    """`checkpoint` archived with these model-config.yaml overrides and served until the block ends.

    The worker is READY when the block starts (its startup time in `startup_s`); every process the
    server started is stopped when it ends. `env` reaches the workers; `with_testing` ships
    tp_llama.testing in the archive (fault injection).
    """
    (rdzv_port,) = free_ports(1)
    build_archive(checkpoint, work / "model_store", name="llama", tp=tp, with_testing=with_testing, overrides=[
        *overrides, f"startupTimeout={startup_timeout}", f"torchrun.rdzv-endpoint=127.0.0.1:{rdzv_port}"])
    ts = TorchServe(work, work / "model_store", "llama", extra_config=extra_config)
    ts.env.update(env or {})
    with ts:
        ts.start()
        ts.startup_s = ts.wait_ready(startup_timeout)
        yield ts
