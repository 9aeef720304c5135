"""model-config.yaml, checked once when a worker starts (and when setup writes the model folder).

A typo in the yaml must stop the worker with a clear message instead of silently serving with
defaults, so unknown keys, wrong types and values out of range are errors, in every block:
TorchServe's own top-level keys and `torchrun:` (which TorchServe only warns about and resets),
and this project's `handler:`. The handler's engine keys (ckpt_dir, mode, dtype, max_seq_len,
max_batch_size, prefill_budget, ...) make its EngineConfig; the others are the server's own.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from tp_llama.config import EngineConfig, bounded, check_fields


@dataclass(frozen=True)
class HandlerSettings:
    engine: EngineConfig
    # How long one TorchServe call may go on decoding while no prompt waits (each call costs a round
    # trip through the frontend, so a call runs several steps; this bounds what a new request waits).
    decode_call_ms: int = bounded(60, 0)
    # Steps go on between calls, while TorchServe carries the replies out and the next call in
    # (handler/llama_handler.py); false: a rank steps only within calls.
    step_between_calls: bool = True
    default_max_new_tokens: int = bounded(128, 1)
    max_new_tokens_limit: int = bounded(1024, 1)
    temperature: float = bounded(0.6, 0)
    top_p: float = bounded(0.9, 0)  # in (0, 1]
    max_request_bytes: int = bounded(1_048_576, 64)
    # Tool calls' prompt and reply format: "llama3_json" (Llama 3.1 / 3.3), "pythonic" (Llama 3.2),
    # "llama4_pythonic" (Llama 4), "none" (tools refused), or "auto": from the checkpoint (serving/tool_use.py).
    tool_format: str = "auto"
    # The key a load_lora_adapter / unload_lora_adapter request sends in X-Lora-Admin-Key (serving/lora_admin.py).
    lora_admin_key: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.tool_format not in ("auto", "llama3_json", "pythonic", "llama4_pythonic", "none"):
            raise ValueError("tool_format must be auto, llama3_json, pythonic, llama4_pythonic or none, "
                             f"got {self.tool_format!r}")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError("default_max_new_tokens must not exceed max_new_tokens_limit")
        if self.lora_admin_key is not None and (not isinstance(self.lora_admin_key, str) or len(self.lora_admin_key) < 16):
            raise ValueError("lora_admin_key must be a string of at least 16 characters")
        if self.engine.lora_runtime_loading and self.lora_admin_key is None:
            raise ValueError("lora_runtime_loading needs lora_admin_key, which load and unload requests must send")


# TorchServe 0.12's own keys and the yaml type each must have (its ModelConfig and ModelConfig.TorchRun
# read these and only these); `handler` is this project's block.
TORCHSERVE_KEYS: dict[str, type] = {
    "minWorkers": int, "maxWorkers": int, "batchSize": int, "maxBatchDelay": int, "responseTimeout": int,
    "startupTimeout": int, "deviceType": str, "deviceIds": list, "parallelType": str, "parallelLevel": int,
    "torchrun": dict, "maxRetryTimeoutInSec": int, "clientTimeoutInMills": int, "jobQueueSize": int,
    "useJobTicket": bool, "sequenceMaxIdleMSec": int, "sequenceTimeoutMSec": int, "maxSequenceJobQueueSize": int,
    "maxNumSequence": int, "continuousBatching": bool, "sequenceBatching": bool, "asyncCommunication": bool,
    "useVenv": bool,
}
TORCHRUN_KEYS: dict[str, type] = {
    "nnodes": int, "nproc-per-node": int, "rdzv-backend": str, "rdzv-endpoint": str, "rdzv-conf": str,
    "monitor-interval": int, "node-rank": int, "OMP_NUMBER_THREADS": int,
}
# At least 1: TorchServe ignores (with a warning) or raises to 1 a value below it; the rest of the integers: >= 0.
POSITIVE = {"batchSize", "nnodes", "nproc-per-node", "OMP_NUMBER_THREADS", "responseTimeout", "startupTimeout",
            "minWorkers", "maxSequenceJobQueueSize", "maxNumSequence", "monitor-interval"}
NOUNS = {int: "an integer", str: "a string", bool: "true or false", list: "a list", dict: "a mapping"}


def _check_value(name: str, key: str, value: Any, kind: type) -> None:
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if ok and kind is int:
        ok = value >= (1 if key in POSITIVE else 0)
    if ok and kind is list:
        ok = all(isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in value)
    if not ok:
        noun = NOUNS[kind] + (" >= 1" if key in POSITIVE else " >= 0" if kind is int else "")
        noun += " of GPU ids" if kind is list else ""
        raise ValueError(f"model-config.yaml: {name} must be {noun}, got {value!r}")


def _unknown(name: str, key: object, known: Mapping[str, Any]) -> ValueError:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ValueError(f"model-config.yaml: unknown key {name}{hint}; allowed: {', '.join(known)}")


def check_model_config(config: Mapping[str, Any] | None) -> HandlerSettings:
    """Every key of model-config.yaml: TorchServe's and torchrun's by name and type, then the handler
    block (settings_from_yaml), whose settings it returns."""
    config = config or {}
    if not isinstance(config.get("handler") or {}, Mapping):
        raise ValueError(f"model-config.yaml: handler must be a mapping of settings, got {config['handler']!r}")
    for key, value in config.items():
        if key == "handler":
            continue
        if key not in TORCHSERVE_KEYS:
            raise _unknown(repr(key), key, {**TORCHSERVE_KEYS, "handler": dict})
        _check_value(key, key, value, TORCHSERVE_KEYS[key])
    if config.get("deviceType") is not None:
        device_of(config["deviceType"])
    for key, value in (config.get("torchrun") or {}).items():
        if key not in TORCHRUN_KEYS:
            raise _unknown(f"torchrun.{key}", key, TORCHRUN_KEYS)
        _check_value(f"torchrun.{key}", key, value, TORCHRUN_KEYS[key])
    return settings_from_yaml(config.get("handler"))


def settings_from_yaml(block: dict[str, Any] | None) -> HandlerSettings:
    """Validate the yaml `handler:` block and fill in defaults."""
    block = dict(block or {})
    engine_keys = {f.name for f in fields(EngineConfig)} - {"device"}  # TorchServe's deviceType says it
    server_keys = {f.name for f in fields(HandlerSettings)} - {"engine"}
    unknown = sorted(set(block) - engine_keys - server_keys, key=str)  # a yaml key may be a number
    if unknown:
        raise ValueError(f"unknown key(s) in the handler block of model-config.yaml: {unknown}")
    if "ckpt_dir" not in block:
        raise ValueError("handler.ckpt_dir must name the checkpoint folder")
    try:
        engine = EngineConfig(**{k: v for k, v in block.items() if k in engine_keys})
        return HandlerSettings(engine, **{k: v for k, v in block.items() if k in server_keys})
    except ValueError as exc:  # its message begins with the key's name
        raise ValueError(f"handler.{exc}") from None


DEVICE_TYPES = {"cpu": "cpu", "gpu": "cuda"}  # TorchServe's deviceType -> EngineConfig.device


def device_of(device_type: str | None) -> str:
    """EngineConfig.device for the yaml's deviceType (absent: wherever this process sees a GPU)."""
    if device_type is None:
        return "auto"
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"model-config.yaml: deviceType must be one of {sorted(DEVICE_TYPES)}, got {device_type!r}")
    return DEVICE_TYPES[device_type]


def resolve_ckpt_dir(ckpt_dir: str, model_dir: str, key: str = "ckpt_dir",
                     holds: str = "params.json, tokenizer.model and consolidated.*.pth") -> str:
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
            f"checkpoint folder {path} (handler.{key}={ckpt_dir!r}) does not exist; "
            f"point handler.{key} in model-config.yaml at a folder with {holds}"
        )
    return path


def resolve_adapters(adapters: dict | None, model_dir: str) -> dict | None:
    """handler.lora_adapters with each folder resolved as resolve_ckpt_dir resolves the checkpoint's."""
    if not adapters:
        return adapters
    resolved = {}
    for name, entry in adapters.items():
        key, holds = f"lora_adapters.{name}", "an adapter (PEFT's or torchtune's files)"
        if isinstance(entry, dict):
            resolved[name] = {**entry, "path": resolve_ckpt_dir(entry["path"], model_dir, key, holds)}
        else:
            resolved[name] = resolve_ckpt_dir(entry, model_dir, key, holds)
    return resolved
