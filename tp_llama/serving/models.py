"""Which model a request runs on: the base, or one of the yaml's LoRA adapters named by its `model` field
(vLLM's convention), and the list /v1/models answers."""

from __future__ import annotations

from typing import Any

from tp_llama.serving.request import RequestError, type_name
from tp_llama.serving.settings import HandlerSettings


def adapter_of(requested: Any, model: str, settings: HandlerSettings) -> str | None:
    """The adapter a request's `model` names, None for the base. Without adapters `model` stays free (any
    string serves the one model); with them an unknown name is a 404 model_not_found, as OpenAI answers."""
    if requested is not None and not isinstance(requested, str):
        raise RequestError(f"model must be a string, got {type_name(requested)}", param="model")
    adapters = settings.engine.lora_adapters or {}
    if requested is None or not adapters or requested == model:
        return None
    if requested not in adapters:
        raise RequestError(f"The model {requested!r} does not exist: this server serves {model!r} and its LoRA "
                           f"adapters {sorted(adapters)}", 404, param="model", code="model_not_found")
    return requested


def models_list(model: str, settings: HandlerSettings) -> dict[str, Any]:
    """The base model, then each adapter with the base as its parent (vLLM's `parent` field)."""
    entry = {"object": "model", "created": 0, "owned_by": "tp-llama-serve"}
    data = [{"id": model, **entry, "root": model, "parent": None}]
    data += [{"id": name, **entry, "root": name, "parent": model} for name in settings.engine.lora_adapters or {}]
    return {"object": "list", "data": data}
