"""The GPU serving check's parts, kept working on CPU between GPU runs: the bundle of what the GPU machine
lacks (checks/gpu_bundle.py), the model folder built without torch-model-archiver's script, and the whole
check (checks/gpu_serve.py: TorchServe's Python worker under torchrun behind the stand-in frontend,
checks/ts_frontend.py) on a small checkpoint, with the bundle first on PYTHONPATH as it is there."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from checks import gpu_bundle
from deploy import make_archive
from tp_llama.testing.synthetic import write_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "b"
    gpu_bundle.build(out)
    return out


def test_bundle_holds_what_the_gpu_machine_lacks_and_no_java(bundle: Path):
    assert {p.name.split("-")[0] for p in bundle.iterdir()} == {
        "ts", "torchserve", "model_archiver", "torch_model_archiver", "llguidance", "tokenizer.model", "COMMIT"}
    described = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                               text=True, timeout=60).stdout.strip()
    assert (bundle / "COMMIT").read_text() == described  # the GPU machine's tree has no .git to say it
    assert not list(bundle.rglob("*.jar")) and not list(bundle.rglob("__pycache__"))
    assert gpu_bundle.size_mib(bundle) < gpu_bundle.LIMIT_MIB
    # First on PYTHONPATH, the bundle's copies are the ones imported (here they are also installed).
    probe = ("import ts, ts.model_service_worker, model_archiver.model_packaging, llguidance, json, importlib.metadata;"
             "print(json.dumps([ts.__file__, model_archiver.__file__, llguidance.__file__,"
             "str(importlib.metadata.distribution('llguidance').locate_file('llguidance'))]))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{bundle}{os.pathsep}{REPO}"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert all(Path(path).is_relative_to(bundle) for path in json.loads(run.stdout))


def test_bundle_over_the_limit_fails_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(gpu_bundle, "LIMIT_MIB", 5)  # llguidance alone is over 5 MiB
    with pytest.raises(SystemExit, match="over the 5 MiB limit"):
        gpu_bundle.build(tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_model_folder_built_without_the_archiver_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Where only the model_archiver package is importable (the GPU machine), its module builds the folder."""
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    assert make_archive.archiver_command()[0] == sys.executable
    ckpt = write_checkpoint(tmp_path / "ckpt", family="llama3", dim=64, n_layers=1, n_heads=4, n_kv_heads=2,
                            vocab_size=512)
    folder = make_archive.build_archive(ckpt, tmp_path / "store", "m", tp=1)
    manifest = json.loads((folder / "MAR-INF" / "MANIFEST.json").read_text())
    assert manifest["model"]["handler"] == "llama_handler.py" and (folder / "tp_llama" / "engine").is_dir()


def test_the_serving_check_passes_on_cpu(bundle: Path, tmp_path: Path):
    run = subprocess.run(
        [sys.executable, "-m", "checks.gpu_serve", "--device", "cpu", "--small", "--clients", "1", "2",
         "--per-client", "2", "--prompt", "40", "--new", "8", "--work", str(tmp_path / "w")],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{bundle}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    for check in ("native", "native, streamed", "completions", "completions, streamed", "chat", "chat, streamed",
                  "JSON schema (chat)", "n = 2", "bad request", "serving after the 4xx", "served, 2 clients"):
        assert any(row.startswith(f"| {check} |") and row.endswith("| ok |") for row in rows), (check, run.stdout)
    levels = [row.split(" | ") for row in rows if row.split(" | ")[0].strip("| ").isdigit()]
    assert [int(level[0].strip("| ")) for level in levels] == [1, 2]
    assert all(float(level[1]) > 0 and float(level[4]) > 0 for level in levels), levels  # served and offline rates
    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not left  # the worker's processes all stopped


def test_the_one_call_gpu_run_names_files_and_modules_that_exist():
    """checks/gpu_run.sh runs only where a GPU is lent: keep it parsing, and every test file and module it runs
    present, so the call a GPU session makes does not fail on a name."""
    script = REPO / "checks" / "gpu_run.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=60).returncode == 0
    text = script.read_text()
    files = re.findall(r"tests/test_\w+\.py", text)
    modules = re.findall(r"python3 -m ((?:bench|checks)\.\w+)", text)
    assert len(files) == 6 and len(modules) == 3
    assert all((REPO / f).is_file() for f in files), files
    assert all(importlib.util.find_spec(m) is not None for m in modules), modules
