"""OpenAI's Responses API, POST /predictions/NAME/VERSION/v1/responses: its request fields into the same
`Job` a chat completion makes (responses_reply.py writes the reply object and its typed events).

The fields are read by the chat path's own checkers: the items become chat messages
(responses_items.py), then `chat_ids` builds the prompt (with the tools in Meta's format),
`fit_max_new_tokens` and `sampling_params` the limits and sampling, `reply_constraint` the grammar of
the tools' calls or of `text.format`. A refusal the chat checkers raise under a chat field's name
(`messages`, `response_format`) is renamed to the Responses field it came from.

The server keeps no responses: `store` is accepted and nothing is kept, `previous_response_id` and
`conversation` are refused naming the field, so a client sends the whole conversation each time (as the
Agents SDK does without a server-side store). Fields that change nothing here (`metadata`, `user`,
`truncation: "disabled"`, ...) are accepted; hosted tools, images, audio and `reasoning` are refused.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from tp_llama.serving.models import adapter_of
from tp_llama.serving.request import (
    ChatTokenizer,
    GrammarSpec,
    Job,
    RequestError,
    boolean_field,
    decode_body,
    fit_max_new_tokens,
    integer_field,
    logprobs_field,
    request_body,
    sampling_params,
    type_name,
)
from tp_llama.serving.responses_items import chat_response_format, chat_tool_choice, chat_tools, input_messages
from tp_llama.serving.responses_reply import RESPONSES, ResponsesReply
from tp_llama.serving.settings import HandlerSettings
from tp_llama.serving.tool_use import ToolUse, chat_ids, reply_constraint

LOGPROBS = "message.output_text.logprobs"
_HONOURED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "seed", "text", "tools",
             "tool_choice", "parallel_tool_calls", "include", "top_logprobs", "stream"}
# Accepted and changing nothing: settings of OpenAI's platform that mean nothing to one local model.
_NO_OP = {"metadata", "user", "store", "truncation", "safety_identifier", "prompt_cache_key", "service_tier",
          "background", "stream_options"}
_STATE = "this server keeps no responses (store is accepted, nothing is kept): send the whole conversation in input"
# Fields refused unless null, each with why.
_REFUSED = {
    "previous_response_id": _STATE,
    "conversation": _STATE,
    "prompt": "stored prompt templates live on OpenAI's platform: send instructions and input",
    "reasoning": "reasoning settings are not supported: the served Llama model has no reasoning channel",
    "max_tool_calls": "max_tool_calls is not supported: parallel_tool_calls false allows one call per reply",
}


def _check_fields(body: dict[str, Any]) -> None:
    for key in body:
        if key not in _HONOURED | _NO_OP | set(_REFUSED):
            raise RequestError(f"Unrecognized request argument supplied: {key}", param=key)
    for key, why in _REFUSED.items():
        if body.get(key) is not None:
            raise RequestError(f"{key}: {why}", param=key)
    for key in ("model", "user", "safety_identifier", "prompt_cache_key"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise RequestError(f"{key} must be a string, got {type_name(body[key])}", param=key)
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise RequestError("metadata must be an object of strings", param="metadata")
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError('truncation must be "disabled": an input longer than the context is refused, never cut',
                           param="truncation")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise RequestError('service_tier must be "auto" or "default"', param="service_tier")
    if boolean_field(body, "background"):
        raise RequestError(f"background: {_STATE}", param="background")
    boolean_field(body, "store")
    options = body.get("stream_options")
    if options is not None:
        if not boolean_field(body, "stream"):
            raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_obfuscation"}:
            raise RequestError("stream_options may hold only include_obfuscation", param="stream_options")
        boolean_field(options, "include_obfuscation")  # no obfuscation is ever added: the stream is not encrypted


def _logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives each output token lists, or None: `include` asks for log-probabilities, and
    `top_logprobs` sets the alternatives (asking for them asks for the log-probabilities too)."""
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(item, str) for item in include):
            raise RequestError(f"include must be an array of strings, got {type_name(include)}", param="include")
        other = [item for item in include if item != LOGPROBS]
        if other:
            raise RequestError(f"include: {other[0]!r} is not supported; this server can include only {LOGPROBS!r}",
                               param="include")
    top = logprobs_field(body, "top_logprobs")
    return top if top is not None else (0 if include else None)


def _renamed(error: RequestError, param: str, *names: tuple[str, str]) -> RequestError:
    """A chat checker's refusal under the Responses field's name."""
    message = str(error)
    for old, new in names:
        message = message.replace(old, new)
    return RequestError(message, error.status, param)


def _prompt(body: dict[str, Any], chat_body: dict[str, Any], tokenizer: ChatTokenizer,
            settings: HandlerSettings) -> tuple[list[int], ToolUse | None]:
    messages = input_messages(body.get("input"), body.get("instructions"), bool(chat_body["tools"]))
    try:
        return chat_ids(chat_body, messages, tokenizer, settings.tool_format)
    except RequestError as exc:
        if exc.param != "messages":
            raise
        raise _renamed(exc, "input", ("messages", "input")) from None


def _constraint(chat_body: dict[str, Any], tools: ToolUse | None) -> GrammarSpec | None:
    try:
        spec = reply_constraint(chat_body, tools, False)
    except RequestError as exc:
        if not (exc.param or "").startswith("response_format"):
            raise
        raise _renamed(exc, "text", ("response_format.json_schema", "text.format"),
                       ("response_format", "text.format")) from None
    return replace(spec, param="text.format") if spec is not None and spec.param == "response_format" else spec


def parse_responses(
    request: dict[str, Any],
    settings: HandlerSettings,
    tokenizer: ChatTokenizer,
    vocab_size: int,
    model: str,
    request_id: str,
    created: int | None = None,
) -> ResponsesReply:
    """Validate one Responses request; raises RequestError naming the field for the client."""
    body = decode_body(request_body(request), settings.max_request_bytes)
    _check_fields(body)
    stream = boolean_field(body, "stream")
    chat_body = {"tools": chat_tools(body.get("tools")), "tool_choice": chat_tool_choice(body.get("tool_choice")),
                 "parallel_tool_calls": body.get("parallel_tool_calls"),
                 "response_format": chat_response_format(body.get("text"))}
    ids, tools = _prompt(body, chat_body, tokenizer, settings)
    max_new_tokens = fit_max_new_tokens(integer_field(body, "max_output_tokens"), "max_output_tokens", len(ids),
                                        settings)
    sampling = {key: body[key] for key in ("temperature", "top_p", "seed") if key in body}
    params = sampling_params(sampling, settings, max_new_tokens, vocab_size, _logprobs(body), False)
    adapter = adapter_of(body.get("model"), model, settings)
    job = Job(ids, params, stream, None, _constraint(chat_body, tools), 1, tools, adapter)
    parallel = body.get("parallel_tool_calls")
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "temperature": params.temperature, "top_p": params.top_p,
            "parallel_tool_calls": (tools.parallel if tools else True) if parallel is None else parallel,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "top_logprobs": params.logprobs, "truncation": "disabled", "user": body.get("user"),
            "store": False, "previous_response_id": None, "reasoning": None, "background": False}
    return ResponsesReply(RESPONSES, job, (), False, adapter or model, "resp_" + request_id,
                          int(time.time()) if created is None else created, echoed=echo)

