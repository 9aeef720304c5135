"""A minimal stand-in for TorchServe's Java frontend: where Java cannot come along (the GPU test
machine: checks/gpu_bundle.py), it launches TorchServe's own Python worker for a model folder the way
the frontend does for `parallelType` and drives it over the worker's socket protocol, behind a small
HTTP server with TorchServe's prediction URLs.

What it copies from TorchServe 0.12 (frontend/server/src/main/java/org/pytorch/serve):
- the launch (wlm/WorkerLifeCycle.attachRunner): `torchrun --nnodes 1 --nproc-per-node N --log-dir
  --rdzv-backend --rdzv-endpoint --rdzv-id NAME_PORT --max-restarts 1 ts/model_service_worker.py
  --sock-type unix --sock-name SOCK.PORT --metrics-config`, run in the model folder with it on
  PYTHONPATH, OMP_NUM_THREADS from the yaml's torchrun block, CUDA_VISIBLE_DEVICES for GPUs;
- one connection to each rank's socket (SOCK.PORT+rank); the load and every batch go to all ranks,
  and only rank 0 answers a batch (ts/model_service_worker.py);
- the messages (util/codec/ModelRequestEncoder and ModelResponseDecoder);
- continuous batching (wlm/ContinuousBatching): each call carries every request in progress, a
  request seen before without its body, until its prediction's `ts_stream_next` header is no longer
  "true"; a request whose client left is dropped from the next call; an idle worker waits
  maxBatchDelay ms to gather a first batch;
- the `url_path` header: the URL's segments after /predictions/NAME/VERSION
  (http/api/rest/InferenceRequestHandler).

Not copied: authorization, management, metrics, timeouts per request, worker restarts.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO

import yaml

END = -1


def _int(value: int) -> bytes:
    return struct.pack("!i", value)


def _field(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return _int(len(raw)) + raw


def load_message(name: str, model_dir: Path, batch_size: int, handler: str, gpu: int) -> bytes:
    return (b"L" + _field(name) + _field(str(model_dir)) + _int(batch_size) + _field(handler) + _int(gpu)
            + _field("") + struct.pack("!?", True))


def inference_message(requests: list[Job]) -> bytes:
    out = bytearray(b"I")
    for job in requests:
        out += _field(job.id)
        for key, value in job.headers.items():
            out += _field(key) + _field(value)
        out += _int(END)
        if not job.sent:  # a request cached in the backend comes without its body
            out += _field("body") + _field(job.content_type) + _field(job.body)
        out += _int(END)
    return bytes(out + _int(END))


class Reader:
    """The worker's replies on one connection (ModelResponseDecoder's fields)."""

    def __init__(self, conn: socket.socket) -> None:
        self.file = conn.makefile("rb")

    def bytes(self, n: int) -> bytes:
        data = self.file.read(n)
        if len(data) != n:
            raise ConnectionError("the worker closed its socket")
        return data

    def int(self) -> int:
        return struct.unpack("!i", self.bytes(4))[0]

    def text(self) -> str:
        n = self.int()
        return self.bytes(n).decode() if n > 0 else ""

    def reply(self) -> tuple[int, str, list[dict[str, Any]]]:
        """(code, message, predictions), each prediction a dict of id, content_type, status, headers, body."""
        code, message, predictions = self.int(), self.text(), []
        while (n := self.int()) != END:
            rid = self.bytes(n).decode()
            content_type, status, phrase = self.text(), self.int(), self.text()
            headers = dict((self.text(), self.text()) for _ in range(self.int()))
            body = self.bytes(self.int())
            predictions.append({"id": rid, "content_type": content_type, "status": status, "phrase": phrase,
                                "headers": headers, "body": body})
        return code, message, predictions


@dataclass
class Job:
    """One HTTP request: its body goes to the worker once; its chunks come back through `chunks`."""

    id: str
    headers: dict[str, str]
    content_type: str
    body: bytes
    chunks: queue.Queue = field(default_factory=queue.Queue)  # prediction dicts, then None at the end
    sent: bool = False
    open: bool = True


class WorkerGroup:
    """TorchServe's Python worker under torchrun, one socket per rank."""

    def __init__(self, model_dir: Path, work: Path, name: str = "llama", port: int = 29500,
                 device_ids: str | None = None) -> None:
        self.model_dir, self.work, self.name, self.port = model_dir.resolve(), work, name, port
        self.config = yaml.safe_load((self.model_dir / "model-config.yaml").read_text())
        torchrun = self.config.get("torchrun", {})
        self.nproc = int(torchrun.get("nproc-per-node", 1))
        self.device_ids = device_ids
        self.sock_base = work / ".ts.sock"
        self.log_path = work / "worker.log"
        self.proc: subprocess.Popen | None = None
        self.log: BinaryIO | None = None
        self.conns: list[socket.socket] = []
        self.reader: Reader | None = None

    def command(self) -> list[str]:
        import ts

        torchrun = self.config.get("torchrun", {})
        worker = Path(ts.__file__).parent / "model_service_worker.py"
        metrics = Path(ts.__file__).parent / "configs" / "metrics.yaml"
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(self.nproc),
                "--log-dir", str(self.work / "torchelastic_ts"), "--rdzv-backend", "c10d",
                *(["--rdzv-endpoint", str(torchrun["rdzv-endpoint"])] if torchrun.get("rdzv-endpoint") else []),
                "--rdzv-id", f"{self.name}_{self.port}", "--max-restarts", "1", str(worker),
                "--sock-type", "unix", "--sock-name", f"{self.sock_base}.{self.port}", "--metrics-config", str(metrics)]

    def start(self, timeout: float = 120.0) -> None:
        """Launch the ranks and connect to each rank's socket."""
        threads = self.config.get("torchrun", {}).get("OMP_NUMBER_THREADS", 1)
        env = {**os.environ, "LOGLEVEL": "INFO", "OMP_NUM_THREADS": str(threads),
               "PYTHONPATH": os.pathsep.join([str(self.model_dir), *filter(None, [os.environ.get("PYTHONPATH")])])}
        if self.device_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.device_ids
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), cwd=self.model_dir, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        for rank in range(self.nproc):
            path = f"{self.sock_base}.{self.port + rank}"
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the worker exited ({self.proc.returncode}) before listening:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no socket {path} after {timeout:.0f} s:\n{self.log_tail()}")
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    conn.connect(path)
                    break
                except OSError:
                    conn.close()
                    time.sleep(0.2)
            self.conns.append(conn)
        self.reader = Reader(self.conns[0])

    def load(self, batch_size: int, gpu: int) -> None:
        """The load message to every rank; wait_loaded() reads their answers."""
        message = load_message(self.name, self.model_dir, batch_size, "llama_handler.py", gpu)
        for conn in self.conns:
            conn.sendall(message)

    def wait_loaded(self) -> None:
        """Raises unless every rank answered its load with 200."""
        for rank, conn in enumerate(self.conns):
            code, text, _ = (self.reader if rank == 0 else Reader(conn)).reply()
            if code != 200:
                raise RuntimeError(f"rank {rank} failed to load ({code} {text}):\n{self.log_tail()}")

    def infer(self, jobs: list[Job]) -> tuple[int, str, list[dict[str, Any]]]:
        message = inference_message(jobs)
        for conn in self.conns:
            conn.sendall(message)
        return self.reader.reply()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout: float = 30.0) -> None:
        for conn in self.conns:
            conn.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        if self.log is not None:
            self.log.close()


class Frontend:
    """HTTP on loopback: POST /predictions/NAME[/VERSION[/PATH]] queued for the batching loop."""

    def __init__(self, worker: WorkerGroup) -> None:
        self.worker = worker
        self.batch_size = int(worker.config.get("batchSize", 1))
        self.delay_s = float(worker.config.get("maxBatchDelay", 100)) / 1000
        self.incoming: queue.Queue[Job] = queue.Queue()
        self.jobs: dict[str, Job] = {}
        self.ids = itertools.count()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.http = QuietServer(("127.0.0.1", 0), _handler_class(self))
        self.port = self.http.server_address[1]
        self.threads = [threading.Thread(target=self.http.serve_forever, daemon=True),
                        threading.Thread(target=self._batching, daemon=True)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.threads[0].is_alive():
            self.http.shutdown()
            self.threads[1].join(30)
        self.http.server_close()

    def _gather(self) -> None:
        """New requests join: without waiting while others run; else after the first, maxBatchDelay."""
        if not self.jobs:
            try:
                job = self.incoming.get(timeout=0.1)
            except queue.Empty:
                return
            self.jobs[job.id] = job
            deadline = time.monotonic() + self.delay_s
            while len(self.jobs) < self.batch_size and (left := deadline - time.monotonic()) > 0:
                try:
                    job = self.incoming.get(timeout=left)
                except queue.Empty:
                    break
                self.jobs[job.id] = job
        while len(self.jobs) < self.batch_size:
            try:
                job = self.incoming.get_nowait()
            except queue.Empty:
                break
            self.jobs[job.id] = job

    def _batching(self) -> None:
        try:
            while not self.stopping.is_set():
                for rid in [rid for rid, job in self.jobs.items() if not job.open]:
                    del self.jobs[rid]
                self._gather()
                if not self.jobs:
                    continue
                batch = list(self.jobs.values())
                code, message, predictions = self.worker.infer(batch)
                for job in batch:
                    job.sent = True
                if code != 200:
                    for job in batch:
                        job.chunks.put({"status": code, "content_type": "application/json", "headers": {},
                                        "body": message.encode()})
                        job.chunks.put(None)
                    self.jobs.clear()
                    continue
                for prediction in predictions:
                    job = self.jobs[prediction["id"]]
                    job.chunks.put(prediction)
                    if prediction["headers"].get("ts_stream_next") != "true":
                        job.chunks.put(None)
                        del self.jobs[job.id]
        except BaseException as exc:  # the worker died: every waiting client gets a 500
            self.error = exc
            waiting = list(self.jobs.values())
            while not self.incoming.empty():
                waiting.append(self.incoming.get_nowait())
            for job in waiting:
                job.chunks.put({"status": 500, "content_type": "text/plain", "headers": {}, "body": repr(exc).encode()})
                job.chunks.put(None)


class QuietServer(ThreadingHTTPServer):
    """A client that closes a kept-alive connection is no error worth a traceback."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


def _handler_class(front: Frontend) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: the check prints its own table
            pass

        def do_POST(self) -> None:
            segments = self.path.split("?")[0].strip("/").split("/")
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if front.error is not None:
                self._send_whole(500, "text/plain", f"the worker failed: {front.error!r}".encode())
                return
            if len(segments) < 2 or segments[0] != "predictions" or segments[1] != front.worker.name:
                self._send_whole(404, "application/json", b'{"code": 404, "message": "no such model"}')
                return
            headers = {key: value for key, value in self.headers.items()}
            headers["url_path"] = "/".join(segments[3:]) if len(segments) > 3 else ""
            headers["explain"] = "False"
            job = Job(f"req-{next(front.ids)}", headers, self.headers.get("Content-Type", ""), body)
            front.incoming.put(job)
            first = job.chunks.get()
            content_type = first["content_type"] or "application/json"
            if first["headers"].get("ts_stream_next") != "true":
                job.chunks.get()  # the end marker
                self._send_whole(first["status"], content_type, first["body"])
                return
            try:
                self.send_response(first["status"])
                self.send_header("Content-Type", content_type)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = first
                while chunk is not None:
                    if chunk["body"]:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk["body"]), chunk["body"]))
                        self.wfile.flush()
                    chunk = job.chunks.get()
                self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client left: the next call leaves its request out
                job.open = False

        def _send_whole(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler
