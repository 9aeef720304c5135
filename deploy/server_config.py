"""TorchServe's config.properties for tp-llama-serve, with secure defaults, in one place.

    python deploy/server_config.py write --model-store DIR --out FILE [--inference-port N]
        [--metrics-port N] [--grpc-inference-port N] [--grpc-management-port N]
        [--management-socket PATH | --management-port N] [--set KEY=VALUE ...] [--keep-from OLD]
    python deploy/server_config.py model-status --config FILE --name NAME [--key-file FILE]

What `write` produces (used by setup_model.sh and tests/serving_util.py):

- every TCP listener (inference, metrics, gRPC inference and management) on 127.0.0.1 only;
- the management API on a unix socket by default, so it is on no TCP port at all; on
  127.0.0.1:PORT, with the model API (register/unregister) turned on, only when a management
  port is asked for;
- `allowed_urls` matching no URL: nothing is registered from a URL (a model, or a workflow: TorchServe's
  workflow API registers and runs code even with the model API off), only by name from model_store;
- token authorization left on (TorchServe's default; no key here can turn it off);
- request bodies over `max_request_size` (2 MiB) refused by the frontend with 413, above the
  handler's own 1 MiB cap (`handler.max_request_bytes`, answered with a precise 400);
- bodies handed to the handler as raw bytes (`decode_input_request=false`);
- metrics in Prometheus format on the metrics port's /metrics (`metrics_mode=prometheus`), the
  handler's own metrics included (`model_metrics_auto_detect=true` registers them when they are
  first reported, so no metrics yaml has to list them; see tp_llama/serving/metrics.py);
- the frontend's logging from deploy/log4j2.xml (`vmargs`): TorchServe's own files, without the
  lines its default configuration writes on every continuous-batching call (see that file).

`--keep-from OLD` carries over the lines of an earlier config.properties whose keys `write` does not
produce itself (token_expiration_min=N, job_queue_size=N, ...), so settings added by hand survive
setup_model.sh rewriting the file; the keys it writes come from its arguments again.

`model-status` prints the worker states of a model ("READY", or e.g. "STARTED" while loading),
asking the management API wherever that config put it (unix socket or TCP), or prints nothing
when the server does not answer (yet).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
from collections.abc import Iterable
from pathlib import Path

MiB = 1024 * 1024
FRONTEND_MAX_REQUEST_SIZE = 2 * MiB
LOOPBACK = "127.0.0.1"
# A regex no URL matches (an empty negative lookahead): TorchServe's default is every file:// and http(s):// URL.
NO_URLS = "(?!)"
# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
UNIX_PATH_MAX = 107
LOG_CONFIG = Path(__file__).resolve().with_name("log4j2.xml")

# Keys fixed by this module: extra lines may not set them (they are what makes it safe).
LOCKED_KEYS = frozenset(
    {
        "inference_address",
        "management_address",
        "metrics_address",
        "grpc_inference_address",
        "grpc_management_address",
        "enable_model_api",
        "allowed_urls",
        "disable_token_authorization",
        "model_store",
    }
)


def _check_port(name: str, port: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"{name} must be a port number in 1..65535, got {port!r}")
    return port


def _parse_extra(lines: Iterable[str]) -> dict[str, str]:
    extra: dict[str, str] = {}
    for line in lines:
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key or "\n" in line:
            raise ValueError(f"extra config lines must look like key=value, got {line!r}")
        if key in LOCKED_KEYS:
            raise ValueError(f"{key} is set by server_config.py itself and cannot be overridden")
        extra[key] = value.strip()
    return extra


def management_address(*, socket_path: str | os.PathLike | None = None, port: int | None = None) -> str:
    """`unix:/abs/path` for a socket, `http://127.0.0.1:PORT` for a port; exactly one of the two."""
    if (socket_path is None) == (port is None):
        raise ValueError("give exactly one of a management socket path or a management port")
    if port is not None:
        return f"http://{LOOPBACK}:{_check_port('management port', port)}"
    path = Path(socket_path)
    if not path.is_absolute():
        raise ValueError(f"the management socket path must be absolute, got {str(path)!r}")
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ValueError(f"the management socket path {path} is longer than {UNIX_PATH_MAX} bytes (a unix "
                         "socket limit); choose a shorter one")
    return f"unix:{path}"


def config_properties(
    model_store: str | os.PathLike,
    *,
    inference_port: int = 8080,
    metrics_port: int = 8082,
    grpc_inference_port: int = 7070,
    grpc_management_port: int = 7071,
    management_socket: str | os.PathLike | None = None,
    management_port: int | None = None,
    max_request_size: int = FRONTEND_MAX_REQUEST_SIZE,
    extra: Iterable[str] = (),
) -> str:
    """The text of config.properties. Management goes to `management_socket` (the default way)
    or, only when `management_port` is given instead, to 127.0.0.1:PORT with the model API on.

    `extra` holds further `key=value` lines (e.g. `initial_worker_port=...` or a different
    `max_request_size` for a test); a key below in LOCKED_KEYS is refused, any other replaces
    the value written here.
    """
    for name, port in (("inference_port", inference_port), ("metrics_port", metrics_port),
                       ("grpc_inference_port", grpc_inference_port),
                       ("grpc_management_port", grpc_management_port)):
        _check_port(name, port)
    if isinstance(max_request_size, bool) or not isinstance(max_request_size, int) or max_request_size < 1:
        raise ValueError(f"max_request_size must be a positive integer, got {max_request_size!r}")
    store = Path(model_store)
    if not store.is_absolute():
        raise ValueError(f"model_store must be an absolute path, got {str(store)!r}")
    management = management_address(socket_path=management_socket, port=management_port)
    values: dict[str, str] = {
        "inference_address": f"http://{LOOPBACK}:{inference_port}",
        "management_address": management,
        "metrics_address": f"http://{LOOPBACK}:{metrics_port}",
        "grpc_inference_address": LOOPBACK,
        "grpc_management_address": LOOPBACK,
        "grpc_inference_port": str(grpc_inference_port),
        "grpc_management_port": str(grpc_management_port),
        # Registering and unregistering models (which runs their code) only with TCP management.
        "enable_model_api": "true" if management_port is not None else "false",
        "allowed_urls": NO_URLS,
        # Unix sockets need netty's native transport (TorchServe's default; stated, not assumed).
        "use_native_io": "true",
        "max_request_size": str(max_request_size),
        "decode_input_request": "false",
        "metrics_mode": "prometheus",
        "model_metrics_auto_detect": "true",
        "model_store": str(store),
        "vmargs": f"-Dlog4j.configurationFile={LOG_CONFIG.as_uri()}",
    }
    values.update(_parse_extra(extra))
    comments = {
        "inference_address": "# Written by deploy/server_config.py. Every TCP listener on loopback only; token\n"
                             "# authorization stays on (TorchServe's default, keys in key_file.json).",
        "management_address": "# The management API: a unix socket unless a port was asked for.",
        "enable_model_api": "# Model register/unregister API: on only with TCP management (--management).",
        "allowed_urls": "# No model or workflow from a URL (the workflow API is on even with the model API off).",
        "max_request_size": "# Bodies over this get 413 from the frontend (the handler's own cap answers 400).",
        "decode_input_request": "# Hand request bodies to the handler as raw bytes, so it can validate them strictly.",
        "metrics_mode": "# /metrics on the metrics port in Prometheus format, with the handler's llama_* metrics\n"
                        "# (registered when first reported: model_metrics_auto_detect).",
        "vmargs": "# The frontend's logging without its per-call lines (deploy/log4j2.xml).",
    }
    lines: list[str] = []
    for key, value in values.items():
        if key in comments:
            lines.append(comments[key])
        lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"


def write_config(path: str | os.PathLike, **kwargs) -> Path:
    """config_properties(**kwargs) written to path; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(config_properties(**kwargs))
    return out


def kept_lines(old: str | os.PathLike, **kwargs) -> list[str]:
    """The `key=value` lines of an earlier config.properties that config_properties(**kwargs) would not
    write itself (hand-added settings such as token_expiration_min), to pass on as `extra`."""
    path = Path(old)
    if not path.is_file():
        return []
    written = set(read_properties_text(config_properties(**kwargs)))
    return [f"{key}={value}" for key, value in read_properties(path).items()
            if key not in written and key not in LOCKED_KEYS]


def read_properties_text(text: str) -> dict[str, str]:
    """key=value pairs of config.properties text (comments and blank lines skipped)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "!")):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def read_properties(path: str | os.PathLike) -> dict[str, str]:
    """key=value pairs of a config.properties (comments and blank lines skipped)."""
    return read_properties_text(Path(path).read_text())


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a unix domain socket (the Host header is just "localhost")."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def connection(address: str, timeout: float = 10.0) -> http.client.HTTPConnection:
    """An HTTP connection to a TorchServe address: `unix:/path` or `http://host:port`."""
    if address.startswith("unix:"):
        return UnixHTTPConnection(address[len("unix:"):], timeout=timeout)
    if address.startswith("http://"):
        host, _, port = address[len("http://"):].rstrip("/").rpartition(":")
        return http.client.HTTPConnection(host, int(port), timeout=timeout)
    raise ValueError(f"unsupported address {address!r} (expected unix:/path or http://host:port)")


def model_status(config: str | os.PathLike, name: str, key_file: str | os.PathLike = "key_file.json",
                 timeout: float = 5.0) -> list[str]:
    """The worker states of model `name` from the management API; [] when there is no answer."""
    address = read_properties(config)["management_address"]
    try:
        key = json.loads(Path(key_file).read_text())["management"]["key"]
        conn = connection(address, timeout=timeout)
        try:
            conn.request("GET", f"/models/{name}", headers={"Authorization": f"Bearer {key}"})
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        if response.status != 200:
            return []
        return [str(worker.get("status")) for worker in json.loads(body)[0]["workers"]]
    except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException):
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write config.properties")
    write.add_argument("--model-store", required=True)
    write.add_argument("--out", required=True, help="the config.properties to write")
    write.add_argument("--inference-port", type=int, default=8080)
    write.add_argument("--metrics-port", type=int, default=8082)
    write.add_argument("--grpc-inference-port", type=int, default=7070)
    write.add_argument("--grpc-management-port", type=int, default=7071)
    where = write.add_mutually_exclusive_group(required=True)
    where.add_argument("--management-socket", help="absolute path of the management API's unix socket")
    where.add_argument("--management-port", type=int,
                       help="serve management on 127.0.0.1:PORT instead, with the model API on")
    write.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                       help="a further config.properties line, e.g. max_request_size=4194304")
    write.add_argument("--keep-from", metavar="OLD",
                       help="carry over OLD's lines whose keys this command does not write (e.g. token_expiration_min)")
    status = commands.add_parser("model-status", help="print the model's worker states, comma-separated")
    status.add_argument("--config", required=True)
    status.add_argument("--name", required=True)
    status.add_argument("--key-file", default="key_file.json")
    a = parser.parse_args(argv)
    if a.command == "model-status":
        print(",".join(model_status(a.config, a.name, a.key_file)))
        return 0
    try:
        settings = dict(
            model_store=Path(a.model_store).resolve(), inference_port=a.inference_port,
            metrics_port=a.metrics_port, grpc_inference_port=a.grpc_inference_port,
            grpc_management_port=a.grpc_management_port, management_socket=a.management_socket,
            management_port=a.management_port)
        kept = kept_lines(a.keep_from, **settings) if a.keep_from else []
        path = write_config(a.out, **settings, extra=[*kept, *a.extra])
        if kept:
            print(f"kept from {a.keep_from}: {', '.join(line.partition('=')[0] for line in kept)}")
    except (OSError, ValueError) as exc:
        print(f"server_config: {exc}", file=sys.stderr)
        return 1
    print(f"config written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
