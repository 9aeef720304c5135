"""The structured-output fields both APIs take: OpenAI's `response_format` and vLLM's `structured_outputs`,
read into one GrammarSpec, or a RequestError naming the field.

- response_format: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object),
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}: the reply is
  constrained to the schema whether `strict` is true or not.
- structured_outputs (vLLM's object, so its clients work unchanged): exactly one of `json` (a schema,
  as an object or its JSON text), `json_object` (true), `regex`, `choice` (an array of strings) or
  `grammar` (GBNF, as vLLM's clients send it, or Lark); `disable_any_whitespace` and
  `disable_fallback` are accepted (replies never hold free whitespace and never fall back).
"""

from __future__ import annotations

import json
from typing import Any

from tp_llama.json_schema import check_has_instance
from tp_llama.serving.request import GrammarSpec, RequestError, client_json, type_name

MAX_CHOICES = 1024
MAX_GRAMMAR_CHARS = 100_000
_ANY_OBJECT = json.dumps({"type": "object"})
_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_OPTIONS = {"disable_any_whitespace", "disable_fallback"}


def constrained_reply(body: dict[str, Any], ignore_eos: bool) -> GrammarSpec | None:
    """grammar_spec, refusing ignore_eos beside it (a grammar ends a reply with the end-of-sequence token)."""
    spec = grammar_spec(body)
    if spec is not None and ignore_eos:
        raise RequestError(f"ignore_eos cannot be combined with {spec.param}: the grammar ends the reply with "
                           "the end-of-sequence token", param="ignore_eos")
    return spec


def grammar_spec(body: dict[str, Any]) -> GrammarSpec | None:
    """The request's constraint, from whichever of the two fields it sends (both: a 400)."""
    fmt, outputs = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and outputs is not None:
        raise RequestError("send only one of response_format and structured_outputs", param="structured_outputs")
    if fmt is not None:
        return _response_format(fmt)
    if outputs is not None:
        return _structured_outputs(outputs)
    return None


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        schema = client_json(schema, param, param)
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"{param} must be a JSON schema (an object), got {type_name(schema)}", param=param)
    text = json.dumps(schema, sort_keys=True, ensure_ascii=False)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise RequestError(f"{param} is {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}", param=param)
    try:
        check_has_instance(schema, param)
    except ValueError as exc:
        raise RequestError(str(exc), param=param) from None
    return text


def _response_format(fmt: Any) -> GrammarSpec | None:
    param = "response_format"
    if not isinstance(fmt, dict):
        raise RequestError(f"{param} must be an object, got {type_name(fmt)}", param=param)
    kind = fmt.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if not isinstance(kind, str) or kind not in allowed:  # an object or array would not even hash
        raise RequestError(f"{param}.type must be one of {sorted(allowed)}, got {kind!r}", param=param)
    extra = sorted(set(fmt) - allowed[kind])
    if extra:
        raise RequestError(f"{param} of type {kind} has unknown field(s) {extra}", param=param)
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json", _ANY_OBJECT, param)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(f"{param}.json_schema must be an object with name and schema", param=param)
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise RequestError(f"{param}.json_schema has unknown field(s) {extra}", param=param)
    for key, kinds in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise RequestError(f"{param}.json_schema.{key} must be a {kinds.__name__}", param=param)
    if "schema" not in spec:
        raise RequestError(f"{param}.json_schema.schema is required", param=param)
    return GrammarSpec("json", _schema_text(spec["schema"], f"{param}.json_schema.schema"), param)


def _structured_outputs(outputs: Any) -> GrammarSpec:
    param = "structured_outputs"
    if not isinstance(outputs, dict):
        raise RequestError(f"{param} must be an object, got {type_name(outputs)}", param=param)
    extra = sorted(set(outputs) - set(_KINDS) - _OPTIONS)
    if extra:
        raise RequestError(f"{param} has unsupported field(s) {extra}; supported: {list(_KINDS)} and "
                           f"{sorted(_OPTIONS)}", param=param)
    for key in _OPTIONS:
        if outputs.get(key) is not None and not isinstance(outputs[key], bool):
            raise RequestError(f"{param}.{key} must be true or false", param=param)
    given = [key for key in _KINDS if outputs.get(key) not in (None, False)]
    if len(given) != 1:
        raise RequestError(f"{param} must set exactly one of {list(_KINDS)}, got {given or 'none'}", param=param)
    kind, value = given[0], outputs[given[0]]
    where = f"{param}.{kind}"
    if kind == "json":
        return GrammarSpec("json", _schema_text(value, where), param)
    if kind == "json_object":
        if value is not True:
            raise RequestError(f"{where} must be true", param=param)
        return GrammarSpec("json", _ANY_OBJECT, param)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise RequestError(f"{where} must be a non-empty array of non-empty strings", param=param)
        if len(value) > MAX_CHOICES:
            raise RequestError(f"{where} may hold at most {MAX_CHOICES} strings, got {len(value)}", param=param)
        return GrammarSpec("choice", json.dumps(value, ensure_ascii=False), param)
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"{where} must be a non-empty string", param=param)
    if len(value) > MAX_GRAMMAR_CHARS:
        raise RequestError(f"{where} is {len(value)} characters; the limit is {MAX_GRAMMAR_CHARS}", param=param)
    return GrammarSpec(kind, value, param)
