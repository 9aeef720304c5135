"""Loading and unloading LoRA adapters while serving, in vLLM's request shapes
(`POST .../v1/load_lora_adapter`, `.../v1/unload_lora_adapter`, `{"lora_name": ...}`).

Only where the yaml allows it (handler.lora_runtime_loading), only by name from the folder the yaml names
(handler.lora_folder: a client never names a path on the server), and only with the admin key
(handler.lora_admin_key, sent as the X-Lora-Admin-Key header) beside the inference key: loading reads files
on every rank and can evict an adapter other clients use.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from tp_llama.serving.request import RequestError, decode_body, request_body, type_name
from tp_llama.serving.settings import HandlerSettings

LOAD, UNLOAD = "v1/load_lora_adapter", "v1/unload_lora_adapter"
PATHS = (LOAD, UNLOAD)
ADMIN_HEADER = "X-Lora-Admin-Key"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def admin_request(path: str, request: dict[str, Any], settings: HandlerSettings,
                  key: str | None) -> tuple[str, str | None]:
    """(the adapter's name, its folder to load; None to unload); RequestError for the client."""
    engine = settings.engine
    if not engine.lora_runtime_loading:
        raise RequestError("loading LoRA adapters while serving is off (handler.lora_runtime_loading)", 404)
    if not hmac.compare_digest((key or "").encode(), (settings.lora_admin_key or "").encode()):
        raise RequestError(f"send the LoRA admin key (handler.lora_admin_key) in the {ADMIN_HEADER} header", 403)
    body = decode_body(request_body(request), settings.max_request_bytes)
    unknown = sorted(set(body) - {"lora_name", "lora_path"})
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; send lora_name (and lora_path, as vLLM clients do)")
    name = body.get("lora_name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(f"lora_name must be a folder name (letters, digits, '.', '_', '-'), got "
                           f"{name if isinstance(name, str) else type_name(name)!r}", param="lora_name")
    catalog = engine.lora_adapters or {}
    if path == UNLOAD:
        if name not in catalog:
            raise RequestError(f"no LoRA adapter {name!r} is loaded; loaded: {sorted(catalog)}", 404,
                               param="lora_name", code="model_not_found")
        return name, None
    if name in catalog:
        raise RequestError(f"the LoRA adapter {name!r} is already loaded", param="lora_name")
    folder = Path(engine.lora_folder) / name
    sent = body.get("lora_path")
    # A NUL byte is checked first: resolve() raises on it, which was the client's 500.
    if sent is not None and (not isinstance(sent, str) or "\0" in sent or Path(sent).resolve() != folder.resolve()):
        raise RequestError(f"this server loads adapters by name from handler.lora_folder only; lora_path may only "
                           f"repeat {str(folder)!r}", param="lora_path")
    if not folder.is_dir():
        raise RequestError(f"no adapter folder {name!r} in handler.lora_folder", 404, param="lora_name")
    return name, str(folder)


def with_catalog(settings: HandlerSettings, catalog: dict[str, object]) -> HandlerSettings:
    """The settings whose adapters (what requests may name, what /v1/models lists) are `catalog`'s."""
    return replace(settings, engine=replace(settings.engine, lora_adapters=dict(catalog)))
