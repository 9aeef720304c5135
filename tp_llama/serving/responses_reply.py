"""The Responses API's replies: one response object, or its typed server-sent events, for a request made
by responses_api.py.

A Responses request is a chat request underneath (an `OpenAIRequest` of one choice): its sequence, the
text followed step by step when streamed, and the tool calls read by `ToolReply` are the chat path's.
Only the writing differs. The reply's text and calls are turned into output items (a `message` with
one `output_text` part, or `function_call` items) by one routine for both modes, which emits the
events as it goes: a streamed reply sends them, a whole one keeps only the items, so the two always
agree. Events come in the API's order with a `sequence_number` counting from 0:

    response.created, response.in_progress,
    per item: response.output_item.added, [response.content_part.added, response.output_text.delta...,
    response.output_text.done, response.content_part.done | response.function_call_arguments.delta...,
    response.function_call_arguments.done], response.output_item.done,
    then response.completed, response.incomplete (max_output_tokens cut the reply) or response.failed.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from tp_llama.engine.sampling import TokenLogprobs
from tp_llama.serving.openai_logprobs import chat_logprobs
from tp_llama.serving.openai_reply import OpenAIRequest, timeout_error
from tp_llama.serving.request import json_line

RESPONSES = "v1/responses"
GRAMMAR_FAILED = "the reply's grammar failed while it was generated (a matcher limit); output holds the reply so far"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass(eq=False)
class ResponsesReply(OpenAIRequest):
    """A Responses request's reply state between calls."""

    echoed: dict[str, Any] = field(default_factory=dict)  # the request's settings every response object repeats
    sequence_number: int = 0
    begun: bool = False  # streamed: response.created went out
    events: list[str] = field(default_factory=list)  # this call's events (a whole reply drops them)
    output: list[dict] = field(default_factory=list)  # the output items so far, in order
    message: dict | None = None  # the message item being written
    calls: list[dict] = field(default_factory=list)  # the function_call items, in the order ToolReply numbers them
    held: list[TokenLogprobs] = field(default_factory=list)  # log-probabilities of tokens whose text is not out yet
    response: dict | None = None  # the last response object

    @property
    def chat(self) -> bool:
        return True  # a chat choice underneath: chat's logprobs objects, no completions lists

    def reply(self, timeout_s: float) -> str:
        """This call's events when streamed; the whole response object once a plain request ends."""
        choice = self.choices[0]
        if self.job.stream:
            self.events = []
            if not self.begun:
                self.begun = True
                self._emit("response.created", response=self._response("in_progress"))
                self._emit("response.in_progress", response=self._response("in_progress"))
            self._take(choice.unsent, choice.pending)
            choice.unsent, choice.pending = "", []
            if self.finished:
                self._close()
            return "".join(self.events)
        if not self.finished:
            return ""
        text = "".join(choice.text) if choice.decoder is not None else self.decode(choice.seq.output)
        self._take(text, choice.seq.logprobs)
        self._close()
        return json_line(self.response)

    # --- items and events --------------------------------------------------------------------

    def _emit(self, kind: str, **fields: Any) -> None:
        """One event, written at once (later changes to an item do not reach it)."""
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        self.events.append(f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n")

    def _take(self, shown: str, logprobs: list[TokenLogprobs]) -> None:
        """Newly shown text and its tokens' log-probabilities: message text, or call deltas under tools."""
        choice = self.choices[0]
        if self.job.params.logprobs is not None:
            self.held += logprobs
        text, deltas = shown, []
        if choice.tool is not None:
            text, deltas = choice.tool.feed(shown)
            if choice.seq.finished:
                text += choice.tool.flush()
        if text:
            self._text(text)
        for delta in deltas:
            if "id" in delta:
                self._open_call(delta["id"], delta["function"]["name"])
            if delta["function"].get("arguments"):
                self._arguments(self.calls[delta["index"]], delta["function"]["arguments"])

    def _where(self, item: dict) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _text(self, text: str) -> None:
        if self.message is None:
            self.message = {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                            "content": []}
            self.output.append(self.message)
            self._emit("response.output_item.added", output_index=len(self.output) - 1, item=self.message)
            part = {"type": "output_text", "text": "", "annotations": []}
            if self.job.params.logprobs is not None:
                part["logprobs"] = []
            self.message["content"].append(part)
            self._emit("response.content_part.added", **self._where(self.message), content_index=0, part=part)
        part = self.message["content"][0]
        logprobs = chat_logprobs(self.held, self.decode, self.raw_bytes)["content"]
        self.held = []
        part["text"] += text
        if "logprobs" in part:
            part["logprobs"] += logprobs
        self._emit("response.output_text.delta", **self._where(self.message), content_index=0, delta=text,
                   logprobs=logprobs)

    def _open_call(self, call_id: str, name: str) -> None:
        """A new function_call item; the call before it is done first, so that items come one after another.
        It is whole: a pythonic call's next one opens only after its closing parenthesis, its arguments sent."""
        if self.calls:
            self._done(self.calls[-1], "completed")
        item = {"id": _item_id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": "",
                "status": "in_progress"}
        self.calls.append(item)
        self.output.append(item)
        self._emit("response.output_item.added", output_index=len(self.output) - 1, item=item)

    def _arguments(self, item: dict, delta: str) -> None:
        item["arguments"] += delta
        self._emit("response.function_call_arguments.delta", **self._where(item), delta=delta)

    def _status(self) -> str:
        reason = self.choices[0].seq.finish_reason
        return {"length": "incomplete", "timeout": "failed", "error": "failed"}.get(reason, "completed")

    def _close(self) -> None:
        """The reply ended: its calls checked (a call cut short stays incomplete, those whole before it were done
        as completed; text that never became a call is the message), the done events of the items not done yet,
        then the last event with the whole response."""
        choice, status = self.choices[0], self._status()
        parsed: list[dict] = []
        if choice.tool is not None:
            content, parsed, is_call = choice.tool.finish()
            if not is_call and not self.calls and content and self.message is None:
                self._text(content)
        for i, call in enumerate(parsed):
            if i == len(self.calls):
                self._open_call(call["id"], call["function"]["name"])
            item, arguments = self.calls[i], call["function"]["arguments"]
            if arguments.startswith(item["arguments"]) and arguments != item["arguments"]:
                self._arguments(item, arguments[len(item["arguments"]):])
            item["arguments"] = arguments
        if self.message is not None and self.held:
            self._text("")  # the last tokens' log-probabilities, whose text came before them
        for item in self.output:
            if item is self.message:
                self._done(item, "completed" if status == "completed" else "incomplete")
            elif item["status"] == "in_progress":  # not done yet: the last call
                self._done(item, "completed" if self.calls.index(item) < len(parsed) else "incomplete")
        self.response = self._response(status)
        self._emit({"completed": "response.completed", "incomplete": "response.incomplete",
                    "failed": "response.failed"}[status], response=self.response)

    def _done(self, item: dict, status: str) -> None:
        """An item's done events, with its status from now on."""
        item["status"] = status
        if item is self.message:
            part = item["content"][0]
            done = {"text": part["text"], "logprobs": part.get("logprobs", [])}
            self._emit("response.output_text.done", **self._where(item), content_index=0, **done)
            self._emit("response.content_part.done", **self._where(item), content_index=0, part=part)
        else:
            self._emit("response.function_call_arguments.done", **self._where(item), name=item["name"],
                       arguments=item["arguments"])
        self._emit("response.output_item.done", output_index=self.output.index(item), item=item)

    def _response(self, status: str) -> dict[str, Any]:
        """The response object: its status, the output items so far, usage once it ended."""
        ended = status != "in_progress"
        usage = self.usage() if ended else None
        error = None
        if status == "failed":
            timed_out = self.choices[0].seq.finish_reason == "timeout"
            error = {"code": "server_error", "message": timeout_error()["message"] if timed_out else GRAMMAR_FAILED}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": [dict(item) for item in self.output] if ended else [], "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **self.echoed,
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}},
        }
