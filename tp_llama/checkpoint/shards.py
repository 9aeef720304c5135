"""Reading a Meta consolidated checkpoint folder: which files, and what is in each."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Container
from pathlib import Path

import torch

from tp_llama.errors import CheckpointError
from tp_llama.parallel.layout import IGNORED_SUFFIXES, is_ignored

_SHARD_NAME = re.compile(r"consolidated\.(\d+)\.pth")


def find_shards(ckpt_dir: str | os.PathLike) -> list[Path]:
    """The consolidated.NN.pth files, in MP-rank order; all of 00..MP-1 must be there."""
    folder = Path(ckpt_dir)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: checkpoint folder not found")
    numbered: dict[int, Path] = {}
    for path in sorted(folder.iterdir()):
        match = _SHARD_NAME.fullmatch(path.name)
        if match:
            other = numbered.setdefault(int(match.group(1)), path)
            if other != path:  # consolidated.0.pth beside consolidated.00.pth: which one holds MP rank 0?
                raise CheckpointError(f"{folder}: {other.name} and {path.name} are both the shard file of MP rank "
                                      f"{int(match.group(1))}; keep one")
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
    return {k: v for k, v in state.items() if not is_ignored(k)}


# The dtypes a 16-bit checkpoint's weights come in; anything else (float8 without its fp8_scales_N.pt, integers)
# would be converted to the serving dtype without its scales, silently wrong.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float_dtypes(state: dict[str, torch.Tensor], path: Path, keys: Container[str]) -> None:
    """Every tensor of `state` in `keys` is a float of 16 bits or more, else the file and tensor are named."""
    for key, tensor in state.items():
        if key in keys and tensor.dtype not in FLOAT_DTYPES:
            why = (": float8 weights need their row scales, fp8_scales_N.pt beside each consolidated.NN.pth "
                   "(Meta's FP8 download)" if tensor.dtype.itemsize == 1 and tensor.is_floating_point() else "")
            raise CheckpointError(f"{path}: tensor {key!r} is {tensor.dtype}; a 16-bit checkpoint holds float16, "
                                  f"bfloat16 or float32 weights{why}")


def check_keys(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], path: Path) -> None:
    problems = (
        ("missing", [k for k in expected if k not in state]),
        ("unexpected", [k for k in state if k not in expected]),
    )
    for kind, keys in problems:
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise CheckpointError(f"{path}: {kind} tensor {keys[0]!r}{more}")
