"""deploy/server_config.py: the config.properties every server of this project runs with.

Secure defaults: every TCP listener on 127.0.0.1, the management API on a unix socket (no TCP
port) unless a port is asked for, the model API off unless it is, nothing that turns token
authorization off, a frontend body cap above the handler's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

import deploy.server_config as server_config
from deploy.server_config import FRONTEND_MAX_REQUEST_SIZE, config_properties, management_address

STORE = Path("/srv/models")
SOCKET = Path("/run/tpls/management.sock")


def parse(text: str) -> dict[str, str]:
    pairs = [line.split("=", 1) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"a key written twice: {keys}"
    return dict(pairs)


def tcp_hosts(config: dict[str, str]) -> dict[str, str]:
    """Every TCP listener the config opens, with the host it binds."""
    hosts = {}
    for key in ("inference_address", "management_address", "metrics_address"):
        address = config[key]
        if address.startswith("unix:"):
            continue
        scheme, _, rest = address.partition("://")
        assert scheme in ("http", "https"), address
        hosts[key] = rest.rsplit(":", 1)[0]
    for key in ("grpc_inference_address", "grpc_management_address"):
        hosts[key] = config[key]  # TorchServe's default for these is 0.0.0.0
    return hosts


@pytest.mark.parametrize("management_port", [None, 9081])
def test_every_tcp_listener_is_on_loopback_and_token_auth_stays_on(management_port: int | None) -> None:
    kwargs = {"management_port": management_port} if management_port else {"management_socket": SOCKET}
    config = parse(config_properties(STORE, **kwargs))
    hosts = tcp_hosts(config)
    assert set(hosts) >= {"inference_address", "metrics_address", "grpc_inference_address", "grpc_management_address"}
    assert set(hosts.values()) == {"127.0.0.1"}, hosts
    assert not any("token" in key for key in config), config  # disable_token_authorization, token_expiration_min
    assert config["decode_input_request"] == "false"
    assert config["model_store"] == str(STORE)


def test_management_is_a_unix_socket_and_the_model_api_off_by_default() -> None:
    config = parse(config_properties(STORE, management_socket=SOCKET))
    assert config["management_address"] == f"unix:{SOCKET}"
    assert config["enable_model_api"] == "false"
    assert config["use_native_io"] == "true"  # TorchServe needs netty's native transport for unix sockets
    assert "management_port" not in config and "8081" not in config_properties(STORE, management_socket=SOCKET)


def test_tcp_management_with_the_model_api_only_when_asked() -> None:
    config = parse(config_properties(STORE, management_port=9081))
    assert config["management_address"] == "http://127.0.0.1:9081"
    assert config["enable_model_api"] == "true"


@pytest.mark.parametrize("management_port", [None, 9081])
def test_nothing_is_registered_from_a_url(management_port: int | None) -> None:
    """TorchServe's workflow API registers a workflow (and runs its code) even with enable_model_api=false,
    from any URL allowed_urls lets through: its default lets every file:// and http(s):// URL through."""
    kwargs = {"management_port": management_port} if management_port else {"management_socket": SOCKET}
    patterns = parse(config_properties(STORE, **kwargs))["allowed_urls"].split(",")
    for url in ("file:///tmp/elsewhere/wf.war", "https://example.com/m.mar", f"file://{STORE}/llama.mar",
                "http://127.0.0.1:8080/x.mar", "s3://bucket/m.mar"):
        assert not any(re.fullmatch(pattern, url) for pattern in patterns), (url, patterns)
    with pytest.raises(ValueError, match="cannot be overridden"):
        config_properties(STORE, **kwargs, extra=["allowed_urls=.*"])


def test_frontend_body_cap_is_above_the_handlers() -> None:
    config = parse(config_properties(STORE, management_socket=SOCKET))
    handler_cap = yaml.safe_load((REPO / "model-config.yaml").read_text())["handler"]["max_request_bytes"]
    assert int(config["max_request_size"]) == FRONTEND_MAX_REQUEST_SIZE == 2 * 1024 * 1024
    assert int(config["max_request_size"]) > handler_cap


def test_extra_lines_add_or_replace_but_cannot_undo_the_defaults() -> None:
    config = parse(config_properties(STORE, management_socket=SOCKET,
                                     extra=["max_request_size=4096", "initial_worker_port=9500"]))
    assert config["max_request_size"] == "4096"
    assert config["initial_worker_port"] == "9500"
    for line in ("disable_token_authorization=true", "inference_address=http://0.0.0.0:8080",
                 "grpc_management_address=0.0.0.0", "management_address=http://0.0.0.0:8081",
                 "enable_model_api=true", "model_store=/elsewhere"):
        with pytest.raises(ValueError, match="cannot be overridden"):
            config_properties(STORE, management_socket=SOCKET, extra=[line])
    with pytest.raises(ValueError, match="key=value"):
        config_properties(STORE, management_socket=SOCKET, extra=["no equals sign"])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        config_properties(STORE)
    with pytest.raises(ValueError, match="exactly one"):
        config_properties(STORE, management_socket=SOCKET, management_port=9081)
    with pytest.raises(ValueError, match="absolute"):
        management_address(socket_path="relative/management.sock")
    with pytest.raises(ValueError, match="longer than"):
        management_address(socket_path="/" + "x" * 120)
    with pytest.raises(ValueError, match="port number"):
        config_properties(STORE, management_socket=SOCKET, inference_port=0)
    with pytest.raises(ValueError, match="absolute"):
        config_properties("models", management_socket=SOCKET)


def test_cli_writes_the_same_config(tmp_path: Path) -> None:
    out = tmp_path / "config.properties"
    done = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "server_config.py"), "write", "--model-store", str(STORE),
         "--out", str(out), "--inference-port", "18080", "--management-socket", str(SOCKET)],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text() == config_properties(STORE, inference_port=18080, management_socket=SOCKET)
    assert server_config.read_properties(out)["management_address"] == f"unix:{SOCKET}"
    refused = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "server_config.py"), "write", "--model-store", str(STORE),
         "--out", str(out), "--management-socket", str(SOCKET), "--set", "disable_token_authorization=true"],
        capture_output=True, text=True, timeout=60,
    )
    assert refused.returncode == 1 and "cannot be overridden" in refused.stderr


def test_model_status_is_empty_when_nothing_answers(tmp_path: Path) -> None:
    config = tmp_path / "config.properties"
    server_config.write_config(config, model_store=STORE, management_socket=tmp_path / "none.sock")
    (tmp_path / "key_file.json").write_text('{"management": {"key": "k"}}')
    assert server_config.model_status(config, "llama", tmp_path / "key_file.json", timeout=2) == []


# Lines TorchServe 0.12's frontend logs on every continuous-batching call (taken from its ts_log.log
# and model_log.log under the default configuration), and lines that must still be logged.
PER_CALL = {
    "org.pytorch.serve": ["Looping backend response at: 1795547847051", "Backend response time: 95",
                          ("result=[METRICS]PredictionTime.Milliseconds:87.71|#ModelName:llama,Level:Model|#type:GAUGE"
                           "|#hostname:vm,1795547875,2a4d9789-acdc-414c-b4f6-bf0d48cecdd7, pattern=[METRICS]")],
    "MODEL_LOG": ["Backend received inference at: 1795547875"],
}
KEPT = {
    "org.pytorch.serve": ["Backend worker process died.", "Model llama loaded.",
                          "W-9000-llama_1.0 State change WORKER_STARTED -> WORKER_MODEL_LOADED"],
    "MODEL_LOG": ["rank 0: request 91e06b45 length after 64 tokens; running 1/64", "Backend worker process died."],
}


def test_the_frontend_logs_from_our_log4j2_config_without_its_per_call_lines() -> None:
    config = parse(config_properties(STORE, management_socket=SOCKET))
    flag, _, uri = config["vmargs"].partition("=")
    assert flag == "-Dlog4j.configurationFile" and uri.startswith("file://")
    path = Path(uri.removeprefix("file://"))
    assert path == REPO / "deploy" / "log4j2.xml" and path.is_file()
    loggers = {node.get("name", "root"): node for node in ET.parse(path).getroot().find("Loggers")}
    assert not [name for name, node in loggers.items() if node.get("level") in ("debug", "trace")]
    for name, node in loggers.items():  # one appender per file: a line goes to each file once
        refs = [ref.get("ref") for ref in node.findall("AppenderRef")]
        assert len(refs) == len(set(refs)), name
        if name != "root" and node.get("additivity") != "false":
            assert not set(refs) & {ref.get("ref") for ref in loggers["root"].findall("AppenderRef")}, name
    for name, dropped in PER_CALL.items():
        regex = loggers[name].find("RegexFilter")
        assert regex.get("onMatch") == "DENY"
        pattern = re.compile(regex.get("regex"))  # log4j matches the whole message (Matcher.matches)
        assert all(pattern.fullmatch(line) for line in dropped), name
        assert not any(pattern.fullmatch(line) for line in KEPT[name]), name
        assert loggers[name].get("level") == "info"


def test_hand_added_lines_survive_a_rewrite_and_the_written_keys_do_not(tmp_path: Path) -> None:
    """setup_model.sh rewrites config.properties on every --serve: token_expiration_min added by hand stays."""
    out = tmp_path / "config.properties"
    write = [sys.executable, str(REPO / "deploy" / "server_config.py"), "write", "--model-store", str(STORE),
             "--out", str(out), "--management-socket", str(SOCKET), "--keep-from", str(out)]
    first = subprocess.run(write, capture_output=True, text=True, timeout=60)  # no earlier file: nothing kept
    assert first.returncode == 0 and "kept" not in first.stdout, first.stderr
    with out.open("a") as f:
        f.write("token_expiration_min=1440\njob_queue_size=50\ninference_address=http://0.0.0.0:9\n")
    again = subprocess.run([*write, "--inference-port", "18080"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    assert "kept from" in again.stdout and "token_expiration_min" in again.stdout
    config = parse(out.read_text())
    assert config["token_expiration_min"] == "1440" and config["job_queue_size"] == "50"
    assert config["inference_address"] == "http://127.0.0.1:18080"  # written keys come from the arguments
    assert server_config.kept_lines(tmp_path / "missing", model_store=STORE, management_socket=SOCKET) == []
