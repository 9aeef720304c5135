"""The native API, POST /predictions/NAME: its request fields and its replies, together.

Reply: {"text", "token_ids", "finish_reason", "usage"} as one JSON object (usage: prompt_tokens,
completion_tokens, and cached_prompt_tokens, the prompt tokens found in the prefix cache), or streamed as one JSON
line per TorchServe call with the new text and ids, the last one carrying finish_reason and usage;
with "logprobs": N, also "logprobs", one entry per token id: its log-probability and the N most
likely tokens'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tp_llama.engine.scheduler import Sequence
from tp_llama.serving.request import (
    ChatTokenizer,
    Job,
    RequestError,
    boolean_field,
    cache_salt_field,
    chat_prompt_ids,
    decode_body,
    fit_max_new_tokens,
    integer_field,
    json_line,
    logprobs_field,
    native_logprobs,
    request_body,
    sampling_params,
    text_prompt_ids,
)
from tp_llama.serving.settings import HandlerSettings
from tp_llama.serving.structured import constrained_reply
from tp_llama.serving.stream import StreamDecoder

FIELDS = ("prompt", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
          "presence_penalty", "repetition_penalty", "logit_bias", "logprobs", "seed", "ignore_eos", "stream", "cache_salt",
          "response_format", "structured_outputs")
JSON_TYPE = "application/json"
NDJSON_TYPE = "application/x-ndjson"


def _prompt_ids(body: dict[str, Any], tokenizer: ChatTokenizer) -> list[int]:
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise RequestError("send exactly one of 'prompt' (text completion) or 'messages' (chat)")
    if has_prompt:
        return text_prompt_ids(body["prompt"], tokenizer)
    return chat_prompt_ids(body["messages"], tokenizer)


def parse_request(request: dict[str, Any], settings: HandlerSettings, tokenizer: ChatTokenizer,
                  vocab_size: int) -> Job:
    """Validate one request of a batch; raises RequestError with a message for the client."""
    body = decode_body(request_body(request), settings.max_request_bytes)
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; allowed: {list(FIELDS)}")
    prompt_ids = _prompt_ids(body, tokenizer)
    max_new_tokens = fit_max_new_tokens(integer_field(body, "max_new_tokens"), "max_new_tokens",
                                        len(prompt_ids), settings)
    ignore_eos = boolean_field(body, "ignore_eos")
    params = sampling_params(body, settings, max_new_tokens, vocab_size, logprobs_field(body, "logprobs"), ignore_eos)
    return Job(prompt_ids, params, boolean_field(body, "stream"), cache_salt_field(body),
               constrained_reply(body, ignore_eos))


class NativeRequest:
    """A native request between its first call and its last reply."""

    stopped = False  # the native API has no stop strings

    def __init__(self, job: Job, decode: Callable[[list[int]], str]):
        self.job, self.decode = job, decode
        self.stream = StreamDecoder(decode) if job.stream else None
        self.seq: Sequence | None = None

    @property
    def content_type(self) -> str:
        return NDJSON_TYPE if self.stream else JSON_TYPE

    def sequences(self, rid: str) -> list[Sequence]:
        job = self.job
        self.seq = Sequence(rid, job.prompt_ids, job.params, job.cache_salt)
        return [self.seq]

    def advance(self) -> list[Sequence]:
        """After a step: nothing to watch (the stream's text is taken when the reply is written)."""
        return []

    def reply(self, timeout_s: float) -> str:
        """This call's reply: the new tokens of a streamed request, or the whole answer at the end."""
        seq = self.seq
        if not seq.finished:
            if self.stream is None:
                return ""
            new, logprobs = seq.take_new_tokens()
            return json_line(self._piece(self.stream.push(new), new, logprobs)) if new else ""
        usage = {"prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.output),
                 "cached_prompt_tokens": seq.cached_tokens or 0}
        if seq.finish_reason == "timeout":
            return json_line({"error": f"the request ran past responseTimeout ({timeout_s:g} s)",
                              "finish_reason": "timeout", "usage": usage})
        if self.stream is None:
            piece = self._piece(self.decode(seq.output), seq.output, seq.logprobs)
        else:
            new, logprobs = seq.take_new_tokens()
            piece = self._piece(self.stream.push(new) + self.stream.finish(), new, logprobs)
        return json_line({**piece, "finish_reason": seq.finish_reason, "usage": usage})

    def _piece(self, text: str, token_ids: list[int], logprobs: list) -> dict[str, Any]:
        piece = {"text": text, "token_ids": token_ids}
        if self.job.params.logprobs is not None:
            piece["logprobs"] = native_logprobs(logprobs)
        return piece
