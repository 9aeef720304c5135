"""The OpenAI-compatible front door: /predictions/NAME/VERSION/v1/completions and .../v1/chat/completions.

TorchServe routes any path below /predictions/NAME/VERSION/ to the handler and passes the tail
as the request header `url_path` ("v1/completions"). This module turns such a request into the
same `Job` the native API makes, with the same field checkers (request.py); openai_reply.py
writes the replies in OpenAI's shapes: a completion object, or server-sent events of chunk
objects ending in `data: [DONE]`, and errors as {"error": {"message", "type", "param", "code"}}.

Only rank 0 reads requests (the other ranks just follow its steps).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from tp_llama.serving.openai_reply import CHAT, COMPLETIONS, OpenAIRequest
from tp_llama.serving.models import adapter_of
from tp_llama.serving.request import (
    cache_salt_field,
    ChatTokenizer,
    Job,
    RequestError,
    boolean_field,
    decode_body,
    fit_max_new_tokens,
    integer_field,
    logprobs_field,
    n_field,
    pickable_ids,
    request_body,
    sampling_params,
    text_prompt_ids,
    type_name,
)
from tp_llama.serving.settings import HandlerSettings
from tp_llama.serving.tool_use import chat_ids, reply_constraint

MODELS = "v1/models"
# Chat content parts that carry media (OpenAI's, and vLLM's URL forms), which a text-only server refuses by name.
MEDIA_PARTS = ("image_url", "input_audio", "file", "audio_url", "video_url")
PATHS = (COMPLETIONS, CHAT)
MAX_STOP_STRINGS = 4
MAX_ECHO_LOGPROBS = 5  # OpenAI's legacy limit; every prompt position then carries this many alternatives
MAX_PROMPTS = 1024  # token-id prompts in one completions request


def _null(value: Any) -> bool:
    return value is None


def _null_or(*allowed: Any):
    return lambda value: value is None or any(value == a and type(value) is type(a) for a in allowed)


# OpenAI fields this server cannot honour: accepted only at their default (or null), else a 400
# that says why. Everything not listed here or in the parsers below is refused as unrecognized,
# as OpenAI itself does.
_DEFAULT_ONLY = {
    COMPLETIONS: {
        "best_of": (_null_or(1), "best_of must be 1"),
        "suffix": (_null, "suffix is not supported"),
    },
    CHAT: {
        "functions": (_null_or([]), "functions are deprecated by OpenAI and not supported: send tools"),
        "function_call": (_null_or("none"), "function_call is deprecated by OpenAI and not supported: send tool_choice"),
        "store": (_null_or(False), "store is not supported"),
    },
}
_HONOURED = {
    COMPLETIONS: {"prompt", "max_tokens", "logprobs", "echo"},
    CHAT: {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
           "parallel_tool_calls"},
}
# ignore_eos, top_k, min_p, repetition_penalty, cache_salt and return_token_ids are vLLM's extensions,
# which its clients send.
_COMMON = {"model", "user", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "ignore_eos",
           "frequency_penalty", "presence_penalty", "logit_bias", "top_k", "min_p", "repetition_penalty", "cache_salt",
           "return_token_ids", "response_format", "structured_outputs", "n"}


def error_body(error: RequestError) -> dict[str, Any]:
    """OpenAI's error object for a refused request."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {"error": {"message": str(error), "type": kind, "param": error.param, "code": error.code}}


def _refuse_unsupported(body: dict[str, Any], path: str) -> None:
    allowed = _COMMON | _HONOURED[path] | set(_DEFAULT_ONLY[path])
    for key in body:
        if key not in allowed:
            raise RequestError(f"Unrecognized request argument supplied: {key}", param=key)
    for key, (accepts, message) in _DEFAULT_ONLY[path].items():
        if key in body and not accepts(body[key]):
            raise RequestError(message, param=key)


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not stops or len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop must be a string or an array of 1 to {MAX_STOP_STRINGS} strings", param="stop")
    for item in stops:
        if not isinstance(item, str):
            raise RequestError(f"stop strings must be strings, got {type_name(item)}", param="stop")
        if not item:
            raise RequestError("stop strings must not be empty", param="stop")
    return tuple(stops)


def _logprobs_asked(body: dict[str, Any], path: str) -> int | None:
    """How many alternatives each token's log-probabilities list (None: no log-probabilities).

    Completions: logprobs, an integer. Chat: logprobs true, with top_logprobs alternatives.
    """
    if path == COMPLETIONS:
        return logprobs_field(body, "logprobs")
    top = logprobs_field(body, "top_logprobs")
    if not boolean_field(body, "logprobs"):
        if top is not None:
            raise RequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        return None
    return top or 0


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {type_name(options)}", param="stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise RequestError(f"stream_options has unknown field(s) {unknown}; allowed: include_usage",
                           param="stream_options")
    return boolean_field(options, "include_usage")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in value)


def _completion_prompts(prompt: Any, tokenizer: ChatTokenizer, vocab_size: int) -> tuple[list[list[int]], list[str | None]]:
    """(the prompts' token ids, each prompt's text where it was sent as text): a string (encoded with BOS,
    like the native API), an array of token ids taken as they are, or an array of such arrays (one
    choice each, as lm-evaluation-harness sends them)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise RequestError(f"prompt may hold at most {MAX_PROMPTS} token-id arrays, got {len(prompt)}",
                               param="prompt")
        for i, ids in enumerate(prompt):
            if not _is_ids(ids):
                raise RequestError(f"prompt[{i}] must be a non-empty array of token ids", param="prompt")
        prompts = [list(ids) for ids in prompt]
    elif _is_ids(prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list):
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        raise RequestError("prompt must be a string, an array of token ids or an array of token-id arrays (an array "
                           "of strings is not supported: one prompt per request, or token ids)", param="prompt")
    else:
        return [text_prompt_ids(prompt, tokenizer)], [prompt]
    for ids in prompts:
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}", param="prompt")
    return prompts, [None] * len(prompts)


def _echo(body: dict[str, Any], prompts: list[list[int]], logprobs: int | None, n_words: int) -> bool:
    """echo: true returns each prompt's tokens and their log-probabilities before the completion."""
    if not boolean_field(body, "echo"):
        return False
    if logprobs is None:
        raise RequestError("echo is not supported without logprobs: send logprobs (0 to "
                           f"{MAX_ECHO_LOGPROBS}) with it for the prompt's log-probabilities", param="echo")
    if logprobs > MAX_ECHO_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_ECHO_LOGPROBS}] with echo, got {logprobs}", param="logprobs")
    bad = [i for ids in prompts for i in ids if i >= n_words]
    if bad:  # a padded embedding row past the tokenizer: no text to echo, no probability to report
        raise RequestError(f"with echo, prompt token ids must be in [0, {n_words}), got {bad[0]}", param="prompt")
    return True


def _penalized_ids(prompts: list[list[int]], repetition_penalty: float, pickable: int) -> None:
    """repetition_penalty reaches each prompt id's logit, and the logits stop at the tokenizer's ids: a padded
    row's id there would fail the step (and with it the worker)."""
    bad = [i for ids in prompts for i in ids if i >= pickable] if repetition_penalty != 1.0 else []
    if bad:
        raise RequestError(f"with repetition_penalty, prompt token ids must be in [0, {pickable}), got {bad[0]}",
                           param="prompt")


def _max_new_tokens(body: dict[str, Any], key: str, prompts: list[list[int]], echo: bool,
                    settings: HandlerSettings) -> int:
    """The native rules for every prompt (the default shrinks to fit the longest); 0 is allowed with echo:
    the prompts' log-probabilities alone."""
    requested = integer_field(body, key)
    if requested == 0:
        if not echo:
            raise RequestError(f"{key} must be >= 1 (0 only with echo), got 0", param=key)
        longest = max(len(ids) for ids in prompts)
        if longest > settings.engine.max_seq_len:
            raise RequestError(f"prompt is {longest} tokens; max_seq_len is {settings.engine.max_seq_len}",
                               param="prompt")
        return 0
    return min(fit_max_new_tokens(requested, key, len(ids), settings) for ids in prompts)


def chat_messages(messages: Any) -> Any:
    """OpenAI's content-part arrays of text parts become tuples of their texts, which the chat templates
    encode part by part as Meta's ChatFormat encodes a list of RawTextItems; the shared rules do the rest.

    A reply's message sent back as a client got it or dumps its model (null refusal, audio, function_call and
    tool_calls, empty annotations) is the plain message; a participant `name` is dropped (Meta's formats have no
    place for one, nor have Hugging Face's Llama templates); `developer` is `system`, as in the Responses API.

    A media part is refused as such, whatever the checkpoint: a client sending an image to a model that
    could see one (Llama 4) learns that this server never loads a vision encoder, not that its part is malformed.
    """
    if not isinstance(messages, list):
        return messages
    plain = []
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            message = {key: value for key, value in message.items()
                       if key != "name" and not (value is None or key == "annotations" and value == [])}
            if message.get("role") == "developer":
                message["role"] = "system"
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind in MEDIA_PARTS:
                    raise RequestError(f"messages[{i}].content[{j}]: {kind} parts are not supported: "
                                       "this server is text-only", param="messages")
                if not (isinstance(part, dict) and part.get("type") == "text" and set(part) == {"type", "text"}
                        and isinstance(part["text"], str)):
                    raise RequestError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                       "are supported", param="messages")
                texts.append(part["text"])
            message = {**message, "content": tuple(texts)}  # each part encoded on its own, as Meta's ChatFormat does
        plain.append(message)
    return plain


def parse_openai(
    path: str,
    request: dict[str, Any],
    settings: HandlerSettings,
    tokenizer: ChatTokenizer,
    vocab_size: int,
    model: str,
    request_id: str,
    created: int | None = None,
) -> OpenAIRequest:
    """Validate one OpenAI request (path is COMPLETIONS or CHAT); raises RequestError for the client."""
    body = decode_body(request_body(request), settings.max_request_bytes)
    _refuse_unsupported(body, path)
    adapter = adapter_of(body.get("model"), model, settings)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(f"user must be a string, got {type_name(user)}", param="user")
    stream = boolean_field(body, "stream")
    ignore_eos = boolean_field(body, "ignore_eos")
    include_usage = _include_usage(body, stream)
    stops = _stop_strings(body)
    logprobs, echo, texts, tools = _logprobs_asked(body, path), False, None, None
    pickable = pickable_ids(vocab_size, tokenizer)
    if path == CHAT:
        if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
            raise RequestError("send only one of max_completion_tokens and max_tokens", param="max_tokens")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        if "messages" not in body:
            raise RequestError("messages is required", param="messages")
        ids, tools = chat_ids(body, chat_messages(body["messages"]), tokenizer, settings.tool_format)
        prompts = [ids]
    else:
        key = "max_tokens"
        if "prompt" not in body:
            raise RequestError("prompt is required", param="prompt")
        prompts, texts = _completion_prompts(body["prompt"], tokenizer, vocab_size)
        echo = _echo(body, prompts, logprobs, pickable)
    max_new_tokens = _max_new_tokens(body, key, prompts, echo, settings)
    params = sampling_params(body, settings, max_new_tokens, pickable, logprobs, ignore_eos)
    _penalized_ids(prompts, params.repetition_penalty, pickable)
    if echo:
        params = replace(params, prompt_logprobs=logprobs)
    grammar = reply_constraint(body, tools, ignore_eos)
    n = n_field(body, settings)
    if len(prompts) * n > MAX_PROMPTS:
        raise RequestError(f"{len(prompts)} prompts with n {n} make more than {MAX_PROMPTS} choices", param="n")
    if n > 1 and max_new_tokens == 0:
        raise RequestError("n > 1 needs max_tokens >= 1 (echo alone scores the prompt once)", param="n")
    job = Job(prompts[0], params, stream, cache_salt_field(body), grammar, n, tools, adapter)
    prefix = "chatcmpl-" if path == CHAT else "cmpl-"
    return OpenAIRequest(path, job, stops, include_usage, adapter or model, prefix + request_id,
                         int(time.time()) if created is None else created,
                         return_token_ids=boolean_field(body, "return_token_ids"), prompts=prompts,
                         prompt_texts=texts or [None], echo=echo)
