"""The `handler:` block of model-config.yaml, checked once when a worker starts.

A typo in the yaml must stop the worker with a clear message instead of silently
serving with defaults, so unknown keys and wrong types are errors.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any

from tp_llama.engine import DEFAULT_MAX_SEQ_LEN, DEFAULT_PREFILL_BUDGET, DEFAULT_SLOTS, MODES

# How long one TorchServe call may go on decoding while no prompt waits (each call costs a round
# trip through the frontend, so a call runs several steps; this bounds what a new request waits).
DEFAULT_DECODE_CALL_MS = 60


@dataclass(frozen=True)
class HandlerSettings:
    ckpt_dir: str
    mode: str = "tp"
    dtype: str | None = None
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    max_batch_size: int = DEFAULT_SLOTS
    prefill_budget: int = DEFAULT_PREFILL_BUDGET
    decode_call_ms: int = DEFAULT_DECODE_CALL_MS
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = 1024
    temperature: float = 0.6
    top_p: float = 0.9
    max_request_bytes: int = 1_048_576


def _int_setting(block: dict[str, Any], key: str, default: int, minimum: int) -> int:
    value = block.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"handler.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _float_setting(block: dict[str, Any], key: str, default: float) -> float:
    value = block.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"handler.{key} must be a finite number, got {value!r}")
    return float(value)


def settings_from_yaml(block: dict[str, Any] | None) -> HandlerSettings:
    """Validate the yaml `handler:` block and fill in defaults."""
    block = dict(block or {})
    known = {f.name for f in fields(HandlerSettings)}
    unknown = sorted(set(block) - known)
    if unknown:
        raise ValueError(f"unknown key(s) in the handler block of model-config.yaml: {unknown}")
    ckpt_dir = block.get("ckpt_dir")
    if not isinstance(ckpt_dir, str) or not ckpt_dir:
        raise ValueError("handler.ckpt_dir must name the checkpoint folder")
    mode = block.get("mode", "tp")
    if mode not in MODES:
        raise ValueError(f"handler.mode must be one of {MODES}, got {mode!r}")
    dtype = block.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise ValueError(f"handler.dtype must be a dtype name or null, got {dtype!r}")
    settings = HandlerSettings(
        ckpt_dir=ckpt_dir,
        mode=mode,
        dtype=dtype,
        max_seq_len=_int_setting(block, "max_seq_len", DEFAULT_MAX_SEQ_LEN, 2),
        max_batch_size=_int_setting(block, "max_batch_size", DEFAULT_SLOTS, 1),
        prefill_budget=_int_setting(block, "prefill_budget", DEFAULT_PREFILL_BUDGET, 1),
        decode_call_ms=_int_setting(block, "decode_call_ms", DEFAULT_DECODE_CALL_MS, 0),
        default_max_new_tokens=_int_setting(block, "default_max_new_tokens", 128, 1),
        max_new_tokens_limit=_int_setting(block, "max_new_tokens_limit", 1024, 1),
        temperature=_float_setting(block, "temperature", 0.6),
        top_p=_float_setting(block, "top_p", 0.9),
        max_request_bytes=_int_setting(block, "max_request_bytes", 1_048_576, 64),
    )
    if settings.temperature < 0:
        raise ValueError("handler.temperature must be >= 0")
    if not 0 < settings.top_p <= 1:
        raise ValueError("handler.top_p must be in (0, 1]")
    if settings.default_max_new_tokens > settings.max_new_tokens_limit:
        raise ValueError("handler.default_max_new_tokens must not exceed handler.max_new_tokens_limit")
    return settings


def resolve_ckpt_dir(ckpt_dir: str, model_dir: str) -> str:
    """An absolute path as is; a relative one from the real model folder.

    TorchServe hands the worker a symlink under its temp folder, so relative paths are
    taken from the folder the link points to (the model store), where users expect them.
    """
    path = os.path.expanduser(ckpt_dir)
    if not os.path.isabs(path):
        path = os.path.join(os.path.realpath(model_dir), path)
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"checkpoint folder {path} (handler.ckpt_dir={ckpt_dir!r}) does not exist; "
            "point handler.ckpt_dir in model-config.yaml at a folder with params.json, "
            "tokenizer.model and consolidated.*.pth"
        )
    return path
