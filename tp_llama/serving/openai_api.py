"""The OpenAI-compatible front door: /predictions/NAME/VERSION/v1/completions and .../v1/chat/completions.

TorchServe routes any path below /predictions/NAME/VERSION/ to the handler and passes the tail
as the request header `url_path` ("v1/completions"). This module turns such a request into the
same `Job` the native API makes, with the same field checkers (request.py), and
writes the replies in OpenAI's shapes: a completion object, or server-sent events of chunk
objects ending in `data: [DONE]`, and errors as {"error": {"message", "type", "param", "code"}}.

Only rank 0 reads requests (the other ranks just follow its steps).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tp_llama.engine.sampling import TokenLogprobs
from tp_llama.engine.scheduler import Sequence
from tp_llama.serving.request import (
    cache_salt_field,
    ChatTokenizer,
    Job,
    RequestError,
    boolean_field,
    chat_prompt_ids,
    decode_body,
    fit_max_new_tokens,
    integer_field,
    json_line,
    logprobs_field,
    request_body,
    sampling_params,
    text_prompt_ids,
    type_name,
)
from tp_llama.serving.settings import HandlerSettings
from tp_llama.serving.stream import StopWatcher, StreamDecoder

COMPLETIONS = "v1/completions"
CHAT = "v1/chat/completions"
MODELS = "v1/models"
PATHS = (COMPLETIONS, CHAT)
MAX_STOP_STRINGS = 4
SSE_TYPE = "text/event-stream"
JSON_TYPE = "application/json"
DONE = "data: [DONE]\n\n"


def _null(value: Any) -> bool:
    return value is None


def _null_or(*allowed: Any):
    return lambda value: value is None or any(value == a and type(value) is type(a) for a in allowed)


# OpenAI fields this server cannot honour: accepted only at their default (or null), else a 400
# that says why. Everything not listed here or in the parsers below is refused as unrecognized,
# as OpenAI itself does.
_DEFAULT_ONLY_COMMON = {
    "n": (_null_or(1), "n must be 1: this server returns one choice per request"),
}
_DEFAULT_ONLY = {
    COMPLETIONS: {
        **_DEFAULT_ONLY_COMMON,
        "echo": (_null_or(False), "echo is not supported"),
        "best_of": (_null_or(1), "best_of must be 1"),
        "suffix": (_null, "suffix is not supported"),
    },
    CHAT: {
        **_DEFAULT_ONLY_COMMON,
        "tools": (_null_or([]), "tools are not supported"),
        "tool_choice": (_null_or("none"), "tool_choice is not supported"),
        "functions": (_null_or([]), "functions are not supported"),
        "function_call": (_null_or("none"), "function_call is not supported"),
        "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), "parallel_tool_calls must be a boolean"),
        "response_format": (_null_or({"type": "text"}), "response_format other than {\"type\": \"text\"} is not supported"),
        "store": (_null_or(False), "store is not supported"),
    },
}
_HONOURED = {
    COMPLETIONS: {"prompt", "max_tokens", "logprobs"},
    CHAT: {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"},
}
# ignore_eos, top_k, min_p, repetition_penalty, cache_salt and return_token_ids are vLLM's extensions,
# which its clients send.
_COMMON = {"model", "user", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "ignore_eos",
           "frequency_penalty", "presence_penalty", "logit_bias", "top_k", "min_p", "repetition_penalty", "cache_salt",
           "return_token_ids"}


def error_body(error: RequestError) -> dict[str, Any]:
    """OpenAI's error object for a refused request."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {"error": {"message": str(error), "type": kind, "param": error.param, "code": None}}


@dataclass(eq=False)
class OpenAIRequest:
    """A parsed OpenAI request and its reply state between calls."""

    path: str
    job: Job
    stops: tuple[str, ...]
    include_usage: bool
    model: str
    id: str
    created: int
    decode: Callable[[list[int]], str] | None = None
    decoder: StreamDecoder | None = None
    watcher: StopWatcher | None = None
    started: bool = False
    text: list[str] = field(default_factory=list)
    pending: list[TokenLogprobs] = field(default_factory=list)  # streamed: log-probabilities not sent yet
    return_token_ids: bool = False  # vLLM's extension: each choice carries its token ids
    pending_ids: list[int] = field(default_factory=list)  # streamed: token ids not sent yet
    offset: int = 0  # completions: where the next token's text starts (text_offset)

    @property
    def chat(self) -> bool:
        return self.path == CHAT

    @property
    def stopped(self) -> bool:
        return self.watcher is not None and self.watcher.hit

    def start(self, decode) -> None:
        """Text is followed step by step when streamed or when stop strings must be watched for."""
        self.decode = decode
        if self.job.stream or self.stops:
            self.decoder = StreamDecoder(decode)
            self.watcher = StopWatcher(self.stops)

    def advance(self, seq: Sequence) -> str:
        """After a step: the newly shown text (stop strings checked). The caller ends the
        sequence when `stopped` turns true."""
        if self.decoder is None:
            return ""
        new, logprobs = seq.take_new_tokens()
        self.pending += logprobs
        if self.return_token_ids:
            self.pending_ids += new
        piece = self.decoder.push(new) if new else ""
        if seq.finished:
            piece += self.decoder.finish()
        shown = self.watcher.feed(piece, final=seq.finished)
        self.text.append(shown)
        return shown

    @property
    def content_type(self) -> str:
        return SSE_TYPE if self.job.stream else JSON_TYPE

    def reply(self, seq: Sequence, shown: str, timeout_s: float) -> str:
        """This call's reply: the new events of a streamed request, or the whole completion at the end."""
        if self.job.stream:
            return self.stream_reply(shown, seq)
        return json_line(self.final_reply(seq)) if seq.finished else ""

    def finish_reason(self, seq: Sequence) -> str:
        return "stop" if self.stopped else seq.finish_reason

    def usage(self, seq: Sequence) -> dict[str, Any]:
        prompt, completion = len(seq.prompt_ids), len(seq.output)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": seq.cached_tokens or 0}}

    # --- replies -----------------------------------------------------------------------------

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, logprobs: list[TokenLogprobs]) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens (chat's `content` list, or completions' four lists)."""
        if self.job.params.logprobs is None:
            return None
        if self.chat:
            def entry(token: int, logprob: float) -> dict[str, Any]:
                text = self.decode([token])
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(*top) for top in t.top]}
                                for t in logprobs]}
        tokens = [self.decode([t.token]) for t in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in logprobs],
                "top_logprobs": [{self.decode([token]): value for token, value in t.top} for t in logprobs],
                "text_offset": offsets}

    def _chunk(self, text: str | None, finish_reason: str | None,
               logprobs: list[TokenLogprobs] = (), token_ids: list[int] = ()) -> dict[str, Any]:
        lp = self._logprobs(list(logprobs)) if logprobs else None
        if self.chat:
            delta: dict[str, Any] = {}
            if not self.started:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            chunk = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
            chunk = {**self._head("text_completion"), "choices": [choice]}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        if self.include_usage:
            chunk["usage"] = None
        self.started = True
        return chunk

    def stream_reply(self, shown: str, seq: Sequence) -> str:
        """This call's server-sent events ("" when there is nothing new)."""
        events: list[dict[str, Any]] = []
        if shown or self.pending or (self.return_token_ids and self.pending_ids) or (self.chat and not self.started):
            events.append(self._chunk(shown, None, self.pending, self.pending_ids))
            self.pending, self.pending_ids = [], []
        if seq.finished:
            if seq.finish_reason == "timeout" and not self.stopped:
                return _sse(events) + _event({"error": timeout_error()}) + DONE
            events.append(self._chunk(None if self.chat else "", self.finish_reason(seq)))
            if self.include_usage:
                events.append({**self._head(events[-1]["object"]), "choices": [], "usage": self.usage(seq)})
            return _sse(events) + DONE
        return _sse(events)

    def final_reply(self, seq: Sequence) -> dict[str, Any]:
        """The whole completion of a request that was not streamed."""
        if seq.finish_reason == "timeout" and not self.stopped:
            return {"error": timeout_error()}
        text = "".join(self.text) if self.decoder is not None else self.decode(seq.output)
        reason = self.finish_reason(seq)
        logprobs = self._logprobs(seq.logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": reason}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
            head = self._head("text_completion")
        if self.return_token_ids:
            choice["token_ids"] = seq.output
        return {**head, "choices": [choice], "usage": self.usage(seq)}


def timeout_error() -> dict[str, Any]:
    return {"message": "the request ran past the server's responseTimeout", "type": "timeout", "param": None,
            "code": None}


def _event(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False) + "\n\n"


def _sse(events: list[dict[str, Any]]) -> str:
    return "".join(_event(e) for e in events)


def models_list(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "tp-llama-serve"}]}


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


def _completion_prompt_ids(prompt: Any, tokenizer: ChatTokenizer, vocab_size: int) -> list[int]:
    """A string (encoded with BOS, like the native API), or an array of token ids taken as they are."""
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        bad = [i for i in prompt if not 0 <= i < vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}", param="prompt")
        return list(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        raise RequestError("prompt must be a string or an array of token ids (one prompt per request)",
                           param="prompt")
    return text_prompt_ids(prompt, tokenizer)


def _chat_messages(messages: Any) -> Any:
    """OpenAI's content-part arrays of text parts become plain strings; the shared rules do the rest."""
    if not isinstance(messages, list):
        return messages
    plain = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and set(part) == {"type", "text"}
                        and isinstance(part["text"], str)):
                    raise RequestError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                       "are supported", param="messages")
                texts.append(part["text"])
            message = {**message, "content": "".join(texts)}
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
    served = body.get("model")
    if served is not None and not isinstance(served, str):
        raise RequestError(f"model must be a string, got {type_name(served)}", param="model")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(f"user must be a string, got {type_name(user)}", param="user")
    stream = boolean_field(body, "stream")
    ignore_eos = boolean_field(body, "ignore_eos")
    include_usage = _include_usage(body, stream)
    stops = _stop_strings(body)
    if path == CHAT:
        if "max_tokens" in body and "max_completion_tokens" in body:
            raise RequestError("send only one of max_completion_tokens and max_tokens", param="max_tokens")
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if "messages" not in body:
            raise RequestError("messages is required", param="messages")
        prompt_ids = chat_prompt_ids(_chat_messages(body["messages"]), tokenizer)
    else:
        key = "max_tokens"
        if "prompt" not in body:
            raise RequestError("prompt is required", param="prompt")
        prompt_ids = _completion_prompt_ids(body["prompt"], tokenizer, vocab_size)
    max_new_tokens = fit_max_new_tokens(integer_field(body, key), key, len(prompt_ids), settings)
    params = sampling_params(body, settings, max_new_tokens, vocab_size, _logprobs_asked(body, path), ignore_eos)
    job = Job(prompt_ids, params, stream, cache_salt_field(body))
    prefix = "chatcmpl-" if path == CHAT else "cmpl-"
    return OpenAIRequest(path, job, stops, include_usage, model, prefix + request_id,
                         int(time.time()) if created is None else created,
                         return_token_ids=boolean_field(body, "return_token_ids"))
