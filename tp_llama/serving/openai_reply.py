"""The OpenAI front door's replies: a completion object, or server-sent events of chunk objects ending in
`data: [DONE]`, for one request of one or more prompts (a completions `prompt` may be a list of
token-id lists: one choice each, `index` in order, as lm-evaluation-harness sends them).

Each choice is one engine sequence. Its text is followed step by step when the reply is streamed
or stop strings must be watched for; with `echo` the prompt's text and log-probabilities come
before the completion's (openai_logprobs.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tp_llama.engine.sampling import TokenLogprobs
from tp_llama.engine.scheduler import Sequence
from tp_llama.serving.openai_logprobs import LegacyLogprobs, RawBytes, chat_logprobs, joined
from tp_llama.serving.request import Job, json_line, sequence_id
from tp_llama.serving.stream import StopWatcher, StreamDecoder
from tp_llama.serving.tool_use import ToolReply

COMPLETIONS = "v1/completions"
CHAT = "v1/chat/completions"
SSE_TYPE = "text/event-stream"
JSON_TYPE = "application/json"
DONE = "data: [DONE]\n\n"


@dataclass(eq=False)
class Choice:
    """One prompt's completion: its sequence and its reply state between calls."""

    index: int
    seq: Sequence
    echo_text: str | None  # echo: the prompt's text, sent before the completion's
    lists: LegacyLogprobs | None = None  # completions' logprobs lists (their offsets run on)
    decoder: StreamDecoder | None = None
    watcher: StopWatcher | None = None
    text: list[str] = field(default_factory=list)  # the text shown so far, piece by piece (followed choices)
    unsent: str = ""  # streamed: text shown but not sent yet
    pending: list[TokenLogprobs] = field(default_factory=list)  # streamed: log-probabilities not sent yet
    pending_ids: list[int] = field(default_factory=list)  # streamed: token ids not sent yet
    echoed: bool = False  # streamed: the prompt part went out
    tool: ToolReply | None = None  # chat with tools: the reply's calls
    started: bool = False  # streamed: its first chunk (chat: the assistant's role) went out
    done: bool = False  # streamed: its finish chunk went out
    followed: bool = False  # its sequence ended and advance took the decoder's last text

    @property
    def stopped(self) -> bool:
        return self.watcher is not None and self.watcher.hit

    @property
    def has_news(self) -> bool:
        """Advance has something to follow: new tokens, or the end of its sequence not yet taken. The others are
        skipped: an ended choice's decoder finished again would decode its whole reply again at every step the
        request's other choices still take."""
        seq = self.seq
        return self.decoder is not None and not self.followed and (seq.reported < len(seq.output) or seq.finished)

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token after the first has its log-probability."""
        return len(self.seq.prompt_logprobs) >= len(self.seq.prompt_ids) - 1


@dataclass(eq=False)
class OpenAIRequest:
    """A parsed OpenAI request and its reply state between calls."""

    path: str
    job: Job  # the first prompt's (every prompt shares its parameters)
    stops: tuple[str, ...]
    include_usage: bool
    model: str
    id: str
    created: int
    return_token_ids: bool = False  # vLLM's extension: each choice carries its token ids
    prompts: list[list[int]] = field(default_factory=list)  # every prompt, the first being job.prompt_ids
    prompt_texts: list[str | None] = field(default_factory=list)  # echo: each prompt as sent, when it was text
    echo: bool = False
    decode: Callable[[list[int]], str] | None = None
    raw_bytes: RawBytes | None = None  # each token's own bytes, for chat's logprobs
    choices: list[Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompts:
            self.prompts = [self.job.prompt_ids]
        if not self.prompt_texts:
            self.prompt_texts = [None] * len(self.prompts)

    @property
    def chat(self) -> bool:
        return self.path == CHAT

    @property
    def stopped(self) -> bool:
        return any(choice.stopped for choice in self.choices)

    @property
    def content_type(self) -> str:
        return SSE_TYPE if self.job.stream else JSON_TYPE

    def start(self, decode: Callable[[list[int]], str], raw_bytes: RawBytes | None = None) -> None:
        self.decode, self.raw_bytes = decode, raw_bytes

    def sequences(self, rid: str) -> list[Sequence]:
        """The engine sequences of the request, n per prompt (made once, at admission): choice p * n + j is
        the j-th of prompt p, as OpenAI numbers them; a prompt's n sequences are one group, prefilled once."""
        job, follow = self.job, self.job.stream or bool(self.stops)
        for i in range(len(self.prompts) * job.n):
            prompt, text = self.prompts[i // job.n], self.prompt_texts[i // job.n]
            first = None if i % job.n == 0 else self.choices[i - i % job.n].seq
            seq = Sequence(sequence_id(rid, i), prompt, job.params, job.cache_salt, adapter=job.adapter, fork_of=first)
            echo = (text if text is not None else self.decode(prompt)) if self.echo else None
            choice = Choice(i, seq, echo, None if self.chat else LegacyLogprobs(self.decode))
            if follow:  # text followed step by step when streamed or when stop strings must be watched for
                choice.decoder, choice.watcher = StreamDecoder(self.decode), StopWatcher(self.stops)
            if job.tools is not None:
                choice.tool = ToolReply(job.tools)
            self.choices.append(choice)
        return [choice.seq for choice in self.choices]

    def advance(self) -> list[Sequence]:
        """After a step: each followed choice's newly shown text (stop strings checked); returns the
        sequences whose stop string just appeared (the caller ends them).

        A step may add several tokens to a sequence (taken proposals, a grammar's forced tokens), and a
        stop string may end inside them: with stop strings the text is watched token by token, and the
        tokens after the one that completed it are dropped, so the reply, its token ids, log-probabilities
        and usage are those of one token a step."""
        stopped = []
        for choice in [choice for choice in self.choices if choice.has_news]:
            seq, start = choice.seq, choice.seq.reported
            new, _ = seq.take_new_tokens()
            choice.followed = seq.finished  # this pass takes the decoder's last text
            if choice.stopped:
                continue
            step = 1 if self.stops else max(len(new), 1)
            for at in range(0, max(len(new), 1), step):
                ids, last = new[at : at + step], at + step >= len(new)
                piece = choice.decoder.push(ids) if ids else ""
                if seq.finished and last:
                    piece += choice.decoder.finish()
                shown = choice.watcher.feed(piece, final=seq.finished and last)
                choice.text.append(shown)
                choice.unsent += shown
                if choice.stopped:
                    seq.cut_output(start + at + len(ids))
                    break
            choice.pending += seq.logprobs[start:]
            if self.return_token_ids:
                choice.pending_ids += seq.output[start:]
            if choice.stopped and not seq.finished:
                stopped.append(seq)
        return stopped

    @property
    def finished(self) -> bool:
        return all(choice.seq.finished for choice in self.choices)

    def reply(self, timeout_s: float) -> str:
        """This call's reply: the new events of a streamed request, or the whole completion at the end."""
        if self.job.stream:
            return self.stream_reply()
        return json_line(self.final_reply()) if self.finished else ""

    def finish_reason(self, choice: Choice) -> str:
        if choice.tool is not None and choice.seq.finished and choice.tool.finished_as_call:
            return "tool_calls"
        return "stop" if choice.stopped else choice.seq.finish_reason

    def timed_out(self) -> bool:
        return any(c.seq.finish_reason == "timeout" and not c.stopped for c in self.choices)

    def usage(self) -> dict[str, Any]:
        """Token counts, each prompt once however many choices it has (n > 1 prefills it once)."""
        firsts = [c.seq for c in self.choices if c.index % self.job.n == 0]  # one choice per prompt
        prompt = sum(len(s.prompt_ids) for s in firsts)
        completion = sum(len(c.seq.output) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens or 0 for s in firsts)}}

    # --- replies -----------------------------------------------------------------------------

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, choice: Choice, logprobs: list[TokenLogprobs], echo: bool = False) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens (chat's `content` list, or completions' four lists,
        the prompt's first when `echo`)."""
        if self.job.params.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(logprobs, self.decode, self.raw_bytes)
        prompt = choice.lists.prompt(choice.seq.prompt_ids, choice.seq.prompt_logprobs) if echo else None
        return joined(prompt, choice.lists.generated(logprobs))

    def _chunk(self, choice: Choice, text: str | None, finish_reason: str | None,
               logprobs: list[TokenLogprobs] = (), token_ids: list[int] = (), calls: list[dict] = ()) -> dict[str, Any]:
        echo = self.echo and not choice.echoed and choice.prompt_scored
        lp = self._logprobs(choice, list(logprobs), echo) if logprobs or echo else None
        if self.chat:
            delta: dict[str, Any] = {}
            if not choice.started:
                delta["role"] = "assistant"
            if text is not None and (text or not calls):
                delta["content"] = text
            if calls:
                delta["tool_calls"] = list(calls)
            choice_out = {"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            chunk = {**self._head("chat.completion.chunk"), "choices": [choice_out]}
        else:
            if echo:
                text, choice.echoed = choice.echo_text + (text or ""), True
            choice_out = {"index": choice.index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
            chunk = {**self._head("text_completion"), "choices": [choice_out]}
        if self.return_token_ids:
            choice_out["token_ids"] = list(token_ids)
        if self.include_usage:
            chunk["usage"] = None
        choice.started = True
        return chunk

    def stream_reply(self) -> str:
        """This call's server-sent events ("" when there is nothing new)."""
        events: list[dict[str, Any]] = []
        for choice in self.choices:
            echo = self.echo and not choice.echoed and choice.prompt_scored and (choice.seq.output
                                                                                 or choice.seq.finished)
            text, calls = choice.unsent, []
            if choice.tool is not None:
                text, calls = choice.tool.feed(choice.unsent)
                if choice.seq.finished:
                    text += choice.tool.flush() + choice.tool.cut_call()
            if (text or calls or choice.pending or (self.return_token_ids and choice.pending_ids)
                    or (self.chat and not choice.started) or echo):
                events.append(self._chunk(choice, text, None, choice.pending, choice.pending_ids, calls))
            choice.unsent, choice.pending, choice.pending_ids = "", [], []
        if self.timed_out():
            return _sse(events) + _event({"error": timeout_error()}) + DONE
        for choice in self.choices:
            if choice.seq.finished and not choice.done:
                events.append(self._chunk(choice, None if self.chat else "", self.finish_reason(choice)))
                choice.done = True
        if self.finished:
            if self.include_usage:
                events.append({**self._head(events[-1]["object"]), "choices": [], "usage": self.usage()})
            return _sse(events) + DONE
        return _sse(events)

    def final_reply(self) -> dict[str, Any]:
        """The whole completion of a request that was not streamed."""
        if self.timed_out():
            return {"error": timeout_error()}
        out = []
        for choice in self.choices:
            seq = choice.seq
            text = "".join(choice.text) if choice.decoder is not None else self.decode(seq.output)
            logprobs = self._logprobs(choice, seq.logprobs, self.echo)
            reason = self.finish_reason(choice)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if choice.tool is not None:
                    message["content"], calls, _ = choice.tool.finish(text)
                    message["tool_calls"] = calls
                    reason = self.finish_reason(choice)
                entry = {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": reason}
            else:
                text = choice.echo_text + text if self.echo else text
                entry = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": reason}
            if self.return_token_ids:
                entry["token_ids"] = seq.output
            out.append(entry)
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": out, "usage": self.usage()}


def timeout_error() -> dict[str, Any]:
    return {"message": "the request ran past the server's responseTimeout", "type": "timeout", "param": None,
            "code": None}


def _event(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False) + "\n\n"


def _sse(events: list[dict[str, Any]]) -> str:
    return "".join(_event(e) for e in events)
