"""Reading a Meta consolidated checkpoint folder: which files, and what is in each."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import torch

from tp_llama.errors import CheckpointError
from tp_llama.parallel.layout import IGNORED_KEYS, IGNORED_SUFFIXES

_SHARD_NAME = re.compile(r"consolidated\.(\d+)\.pth")


def find_shards(ckpt_dir: str | os.PathLike) -> list[Path]:
    """The consolidated.NN.pth files, in MP-rank order; all of 00..MP-1 must be there."""
    folder = Path(ckpt_dir)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: checkpoint folder not found")
    numbered = {}
    for path in folder.iterdir():
        match = _SHARD_NAME.fullmatch(path.name)
        if match:
            numbered[int(match.group(1))] = path
    if not numbered:
        raise CheckpointError(f"{folder}: no consolidated.NN.pth files")
    missing = [i for i in range(max(numbered) + 1) if i not in numbered]
    if missing:
        names = ", ".join(f"consolidated.{i:02d}.pth" for i in missing)
        raise CheckpointError(f"{folder}: missing shard file(s) {names} (found {len(numbered)} of {max(numbered) + 1})")
    return [numbered[i] for i in range(len(numbered))]


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    """Map one shard file lazily; weights_only refuses anything but tensors and containers, and the
    io.BytesIO that Llama 4's files hold as `_extra_state` (dropped here with its other non-parameters)."""
    try:
        with torch.serialization.safe_globals([io.BytesIO]):
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be read as a PyTorch checkpoint ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, got {type(state).__name__}")
    state = {key: value for key, value in state.items() if not key.endswith(IGNORED_SUFFIXES)}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
    return {k: v for k, v in state.items() if k not in IGNORED_KEYS}


def check_keys(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], path: Path) -> None:
    problems = (
        ("missing", [k for k in expected if k not in state]),
        ("unexpected", [k for k in state if k not in expected]),
    )
    for kind, keys in problems:
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise CheckpointError(f"{path}: {kind} tensor {keys[0]!r}{more}")
