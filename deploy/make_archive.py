"""Build the TorchServe model folder (no-archive format) for a checkpoint.

    python deploy/make_archive.py --ckpt-dir DIR [--tp N] [--name NAME] [--model-store DIR]
                                  [--config model-config.yaml] [--set KEY=VALUE ...] [--with-testing]

The folder holds the handler, the tp_llama package (without tp_llama.testing unless asked for)
and a copy of model-config.yaml with nproc-per-node and ckpt_dir filled in; never the weights,
which the handler reads from ckpt_dir. Used by setup_model.sh and the server tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script: tp_llama from this checkout
from tp_llama.checkpoint.loader import check_fsdp_world  # noqa: E402
from tp_llama.checkpoint.params import read_params  # noqa: E402
from tp_llama.checkpoint.shards import find_shards  # noqa: E402
from tp_llama.parallel.layout import check_tp_size  # noqa: E402
from tp_llama.serving.settings import check_model_config  # noqa: E402
from tp_llama.tokenizer import load_tokenizer  # noqa: E402

HANDLER = REPO / "handler" / "llama_handler.py"


def apply_override(config: dict[str, Any], assignment: str) -> None:
    """`a.b=value`: set config["a"]["b"] to value parsed as yaml (so numbers stay numbers)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ValueError(f"--set expects KEY=VALUE, got {assignment!r}")
    *parents, leaf = key.split(".")
    node = config
    for depth, part in enumerate(parents):
        if node.get(part) is None:  # absent, or null in the yaml (lora_adapters: null): a block of its own now
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ValueError(f"--set {assignment}: {'.'.join(parents[:depth + 1])} is not a block of keys")
    try:
        node[leaf] = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ValueError(f"--set {assignment}: the value is not YAML ({exc})") from None


def archiver_command() -> list[str]:
    """torch-model-archiver next to this Python (the venv), else from PATH, else its module run by this
    Python (the GPU check's machine has it only on PYTHONPATH: checks/gpu_bundle.py)."""
    found = shutil.which("torch-model-archiver", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is not None:
        return [found]
    if importlib.util.find_spec("model_archiver") is not None:
        return [sys.executable, "-m", "model_archiver.model_packaging"]
    raise FileNotFoundError("torch-model-archiver not found; pip install -r requirements.txt")


def model_config(template: Path, ckpt_dir: Path, tp: int, overrides: list[str]) -> dict[str, Any]:
    try:
        config = yaml.safe_load(template.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{template}: not YAML ({exc})") from None
    if not isinstance(config, dict) or not all(isinstance(config.get(k, {}), dict) for k in ("torchrun", "handler")):
        raise ValueError(f"{template}: a model-config.yaml is a mapping whose torchrun and handler are blocks of keys")
    config.setdefault("torchrun", {})["nproc-per-node"] = tp
    config.setdefault("handler", {})["ckpt_dir"] = str(ckpt_dir)
    for assignment in overrides:
        apply_override(config, assignment)
    handler = config["handler"]
    if isinstance(handler, dict) and handler.get("ckpt_dir") != str(ckpt_dir):  # else the folder written is unchecked
        raise ValueError("--set may not change handler.ckpt_dir: name the checkpoint folder with --ckpt-dir, whose "
                         "checks (params.json, the TP size or fsdp world it allows) the model folder needs")
    check_model_config(config)  # the worker would refuse it at load: say so now
    return config


def check_tp(ckpt: Path, config: dict[str, Any]) -> None:
    """A TP size that cuts a head in two: the worker would refuse it at load, over and over as
    TorchServe retries it, while setup waits for READY; say so now. In fsdp mode the world size must
    be a multiple of the checkpoint's MP size instead (the loader's rule)."""
    world = config["torchrun"]["nproc-per-node"]
    if config["handler"].get("mode", "tp") != "tp":
        check_fsdp_world(len(find_shards(ckpt)), world)
        return
    tokenizer = ckpt / "tokenizer.model"
    vocab = load_tokenizer(tokenizer).n_words if tokenizer.is_file() else None
    check_tp_size(read_params(ckpt, vocab), world)


def stage_extra_files(stage: Path, with_testing: bool) -> Path:
    """The tp_llama package, laid out as it must sit in the model folder."""
    extra = stage / "extra"
    skip = ["__pycache__", "*.pyc", *([] if with_testing else ["testing"])]
    shutil.copytree(REPO / "tp_llama", extra / "tp_llama", ignore=shutil.ignore_patterns(*skip))
    return extra


def build_archive(
    ckpt_dir: str | os.PathLike,
    model_store: str | os.PathLike,
    name: str = "llama",
    tp: int = 2,
    config: str | os.PathLike = REPO / "model-config.yaml",
    overrides: list[str] | None = None,
    with_testing: bool = False,
) -> Path:
    """Write MODEL_STORE/NAME, replacing an older one; returns its path.

    with_testing: ship tp_llama.testing too (tests that inject faults into the server need it).
    """
    ckpt = Path(ckpt_dir).resolve()
    if not (ckpt / "params.json").is_file():
        raise FileNotFoundError(f"{ckpt} has no params.json; is it a Meta Llama checkpoint folder?")
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    store = Path(model_store).resolve()
    store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tpls-archive-") as tmp:
        stage = Path(tmp)
        config_file = stage / "model-config.yaml"
        written = model_config(Path(config), ckpt, tp, overrides or [])
        check_tp(ckpt, written)
        config_file.write_text(yaml.safe_dump(written, sort_keys=False))
        extra = stage_extra_files(stage, with_testing)
        # torch-model-archiver stages files in $TMPDIR/NAME and deletes that folder first,
        # so it gets a private TMPDIR instead of the shared /tmp.
        (stage / "tmp").mkdir()
        env = dict(os.environ, TMPDIR=str(stage / "tmp"))
        command = [
            *archiver_command(),
            "--model-name", name, "--version", "1.0",
            "--handler", str(HANDLER),
            "--config-file", str(config_file),
            "--extra-files", str(extra),
            "--archive-format", "no-archive",
            "--export-path", str(store),
            "--force",
        ]
        subprocess.run(command, check=True, env=env, cwd=stage)
    return store / name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--tp", type=int, default=2, help="ranks per worker (torchrun nproc-per-node)")
    parser.add_argument("--name", default="llama")
    parser.add_argument("--model-store", default=str(REPO / "model_store"))
    parser.add_argument("--config", default=str(REPO / "model-config.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a model-config.yaml key, e.g. handler.max_seq_len=4096")
    parser.add_argument("--with-testing", action="store_true", help="ship tp_llama.testing (fault injection)")
    a = parser.parse_args(argv)
    try:
        path = build_archive(a.ckpt_dir, a.model_store, a.name, a.tp, a.config, a.overrides, a.with_testing)
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        print(f"make_archive: {exc}", file=sys.stderr)
        return 1
    print(f"model folder written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
