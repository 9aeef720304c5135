"""The native API, POST /predictions/NAME: its request fields and its replies, together.

Reply: {"text", "token_ids", "finish_reason", "usage"} as one JSON object (usage: prompt_tokens,
completion_tokens, and cached_prompt_tokens, the prompt tokens found in the prefix cache), or streamed as one JSON
line per TorchServe call with the new text and ids, the last one carrying finish_reason and usage;
with "logprobs": N, also "logprobs", one entry per token id: its log-probability and the N most
likely tokens'. With "n" > 1: {"choices": [{"index", "text", "token_ids", "finish_reason"}, ...], "usage"}
(the prompt counted once), streamed as one JSON line per choice and call, each with its "index", and a
last line of {"usage"}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tp_llama.engine.scheduler import Sequence
from tp_llama.serving.models import adapter_of
from tp_llama.serving.request import (
    ChatTokenizer,
    Job,
    RequestError,
    boolean_field,
    cache_salt_field,
    decode_body,
    fit_max_new_tokens,
    integer_field,
    json_line,
    logprobs_field,
    n_field,
    native_logprobs,
    pickable_ids,
    request_body,
    sampling_params,
    sequence_id,
    text_prompt_ids,
)
from tp_llama.serving.settings import HandlerSettings
from tp_llama.serving.tool_use import ToolReply, ToolUse, chat_ids, reply_constraint, tool_use
from tp_llama.serving.stream import StreamDecoder

FIELDS = ("prompt", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
          "presence_penalty", "repetition_penalty", "logit_bias", "logprobs", "seed", "ignore_eos", "stream", "cache_salt",
          "response_format", "structured_outputs", "n", "tools", "tool_choice", "parallel_tool_calls", "model")
JSON_TYPE = "application/json"
NDJSON_TYPE = "application/x-ndjson"


def _prompt_ids(body: dict[str, Any], tokenizer: ChatTokenizer, tool_format: str) -> tuple[list[int], ToolUse | None]:
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise RequestError("send exactly one of 'prompt' (text completion) or 'messages' (chat)")
    if has_prompt:
        if body.get("tools"):
            raise RequestError("tools need messages (a chat)", param="tools")
        tool_use(body, tool_format, getattr(tokenizer, "family", None))  # its tool_choice and parallel_tool_calls
        return text_prompt_ids(body["prompt"], tokenizer), None
    return chat_ids(body, body["messages"], tokenizer, tool_format)


def parse_request(request: dict[str, Any], settings: HandlerSettings, tokenizer: ChatTokenizer,
                  vocab_size: int, model: str = "llama") -> Job:
    """Validate one request of a batch; raises RequestError with a message for the client. model: the served
    model's name, which `model` may name beside the LoRA adapters (serving/models.py)."""
    body = decode_body(request_body(request), settings.max_request_bytes)
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; allowed: {list(FIELDS)}")
    prompt_ids, tools = _prompt_ids(body, tokenizer, settings.tool_format)
    max_new_tokens = fit_max_new_tokens(integer_field(body, "max_new_tokens"), "max_new_tokens",
                                        len(prompt_ids), settings)
    ignore_eos = boolean_field(body, "ignore_eos")
    params = sampling_params(body, settings, max_new_tokens, pickable_ids(vocab_size, tokenizer),
                             logprobs_field(body, "logprobs"), ignore_eos)
    return Job(prompt_ids, params, boolean_field(body, "stream"), cache_salt_field(body),
               reply_constraint(body, tools, ignore_eos), n_field(body, settings), tools,
               adapter_of(body.get("model"), model, settings))


class NativeRequest:
    """A native request between its first call and its last reply."""

    stopped = False  # the native API has no stop strings

    def __init__(self, job: Job, decode: Callable[[list[int]], str]):
        self.job, self.decode = job, decode
        self.streams = [StreamDecoder(decode) for _ in range(job.n)] if job.stream else None
        self.seqs: list[Sequence] = []
        self.done: set[int] = set()  # streamed, n > 1: the choices whose last line went out
        self.texts = [""] * job.n  # streamed: each choice's text so far (its calls are read from it at the end)

    @property
    def content_type(self) -> str:
        return NDJSON_TYPE if self.streams else JSON_TYPE

    def sequences(self, rid: str) -> list[Sequence]:
        """The request's sequences: one, or a group of n prefilled once."""
        job = self.job
        for i in range(job.n):
            first = self.seqs[0] if self.seqs else None
            self.seqs.append(Sequence(sequence_id(rid, i), job.prompt_ids, job.params, job.cache_salt,
                                      adapter=job.adapter, fork_of=first))
        return self.seqs

    def advance(self) -> list[Sequence]:
        """After a step: nothing to watch (the stream's text is taken when the reply is written)."""
        return []

    def usage(self) -> dict[str, Any]:
        first = self.seqs[0]
        return {"prompt_tokens": len(first.prompt_ids), "completion_tokens": sum(len(s.output) for s in self.seqs),
                "cached_prompt_tokens": first.cached_tokens or 0}

    def reply(self, timeout_s: float) -> str:
        """This call's reply: the new tokens of a streamed request, or the whole answer at the end."""
        finished = all(seq.finished for seq in self.seqs)
        if any(seq.finish_reason == "timeout" for seq in self.seqs) and finished:
            return self._unsent() + json_line({"error": f"the request ran past responseTimeout ({timeout_s:g} s)",
                                               "finish_reason": "timeout", "usage": self.usage()})
        if self.streams is None:
            if not finished:
                return ""
            pieces = [self._last(self.decode(s.output), s.output, s.logprobs, s) for s in self.seqs]
            if self.job.n == 1:
                return json_line({**pieces[0], "usage": self.usage()})
            return json_line({"choices": [{"index": i, **p} for i, p in enumerate(pieces)], "usage": self.usage()})
        lines = [self._streamed(i, seq) for i, seq in enumerate(self.seqs)]
        if self.job.n == 1:
            line = lines[0]
            if line is not None and finished:
                line["usage"] = self.usage()
            return json_line(line) if line is not None else ""
        out = "".join(json_line({"index": i, **line}) for i, line in enumerate(lines) if line is not None)
        return out + (json_line({"usage": self.usage()}) if finished else "")

    def _unsent(self) -> str:
        """Streamed: the lines of the tokens made since the last call (the steps between calls), which go out
        before a timeout's error line, as its usage counts them; "" for a whole reply."""
        if self.streams is None:
            return ""
        out = ""
        for i, seq in enumerate(self.seqs):
            if i in self.done:
                continue
            text, new, logprobs = self._new(i, seq)
            if new or text:
                piece = self._piece(text, new, logprobs)
                out += json_line(piece if self.job.n == 1 else {"index": i, **piece})
        return out

    def _streamed(self, i: int, seq: Sequence) -> dict[str, Any] | None:
        """Choice i's new text and ids since the last call, with its finish_reason once it ends."""
        if i in self.done:
            return None
        text, new, logprobs = self._new(i, seq)
        if seq.finished:
            return self._last(text, new, logprobs, seq, self.texts[i])
        return self._piece(text, new, logprobs) if new else None

    def _new(self, i: int, seq: Sequence) -> tuple[str, list[int], list]:
        """Choice i's text, token ids and log-probabilities since the last call; once it has ended, the decoder's
        rest too, and the choice is done."""
        new, logprobs = seq.take_new_tokens()
        text = self.streams[i].push(new)
        if seq.finished:
            self.done.add(i)
            text += self.streams[i].finish()
        self.texts[i] += text
        return text, new, logprobs

    def _last(self, text: str, token_ids: list[int], logprobs: list, seq: Sequence,
              whole: str | None = None) -> dict[str, Any]:
        """A choice's last piece: with tools, the reply's calls (OpenAI's shape) and finish_reason tool_calls."""
        piece = {**self._piece(text, token_ids, logprobs), "finish_reason": seq.finish_reason}
        if self.job.tools is not None:
            _, calls, is_call = ToolReply(self.job.tools).finish(text if whole is None else whole)
            piece["tool_calls"] = calls
            if is_call and seq.finish_reason == "stop":
                piece["finish_reason"] = "tool_calls"
        return piece

    def _piece(self, text: str, token_ids: list[int], logprobs: list) -> dict[str, Any]:
        piece = {"text": text, "token_ids": token_ids}
        if self.job.params.logprobs is not None:
            piece["logprobs"] = native_logprobs(logprobs)
        return piece
