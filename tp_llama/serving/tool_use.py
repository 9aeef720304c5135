"""Tool calling on /v1/chat/completions: the request's `tools`, `tool_choice` and `parallel_tool_calls`,
the prompt and grammar they make, and the reply's `tool_calls`, whole or streamed as OpenAI's deltas.

The prompt and the reply formats are Meta's (tp_llama/tool_format.py, tool_calls.py): `llama3_json`
(Llama 3.1 / 3.3: one call per reply), `pythonic` (Llama 3.2: a list of calls) or `llama4_pythonic`
(Llama 4: a list of calls), chosen by the yaml's `tool_format` (by default from the checkpoint: a
Llama 4 tokenizer is Llama 4's, the 1B and 3B shapes are Llama 3.2's). `required`
and named choices are enforced by a grammar built from the tools' parameter schemas, so the call
always parses and its arguments validate; `auto` lets the model answer in text or start a call, and
a started call is held to the schemas from its first token on; `none` adds no grammar.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from tp_llama.serving.request import ChatTokenizer, GrammarSpec, RequestError, chat_prompt_ids, type_name
from tp_llama.serving.structured import constrained_reply
from tp_llama.tool_calls import parse_tool_calls, tool_call_grammar
from tp_llama.tool_format import encode_tool_chat, tool_functions

TOOL_FORMATS = ("auto", "llama3_json", "pythonic", "llama4_pythonic", "none")
LLAMA32_MAX_DIM = 3072  # Llama 3.2's text models (1B: 2048, 3B: 3072); Llama 3.1 / 3.3 start at 8B (4096)
PYTHON_TAG = "<|python_tag|>"
# What may come before a call: the grammar's and parse_tool_calls' whitespace, not all that str.strip drops.
CALL_SPACE = " \t\n\r"
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def resolve_tool_format(setting: str, family: str, dim: int | None = None) -> str:
    """The yaml's `tool_format` with "auto" resolved from the checkpoint: "none" for a Llama 2 (it has no
    tool-calling format), Llama 4's list for a Llama 4, Llama 3.2's pythonic list for its 1B and 3B
    shapes, else Llama 3.1's JSON."""
    if setting != "auto":
        return setting
    if family == "llama4":
        return "llama4_pythonic"
    if family != "llama3":
        return "none"
    return "pythonic" if dim is not None and dim <= LLAMA32_MAX_DIM else "llama3_json"


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools: the OpenAI `tools`, the choice, the reply format and whether calls may be several."""

    tools: list[dict]
    choice: str | dict
    fmt: str
    parallel: bool

    @property
    def grammar(self) -> GrammarSpec | None:
        """The reply's constraint: none for tool_choice "none", else the calls' grammar."""
        if self.choice == "none":
            return None
        try:
            text = tool_call_grammar(self.tools, self.choice, self.fmt, self.parallel)
        except ValueError as exc:
            raise RequestError(f"tools: {exc}", param="tools") from None
        except RecursionError:  # a parameter schema nested past what building its rules recurses
            raise RequestError("tools: a parameter schema is nested too deeply", param="tools") from None
        return GrammarSpec("lark", text, "tools")

    def prompt_ids(self, messages: Any, tokenizer: ChatTokenizer) -> list[int]:
        try:
            return encode_tool_chat(tokenizer, messages, self.tools, self.fmt, tool_choice=self.choice)
        except ValueError as exc:
            raise RequestError(f"invalid messages: {exc}", param="messages") from None
        except RecursionError:  # a history call's arguments nested past what the JSON reader or writer recurses
            raise RequestError("invalid messages: a tool call's arguments are nested too deeply",
                               param="messages") from None


def tool_use(body: dict[str, Any], tool_format: str, family: str | None) -> ToolUse | None:
    """The request's tool fields, checked; None when it sends no tools (`tool_format`: the yaml's, resolved
    at load; "auto" still, from the tokenizer's family alone)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls must be true or false, got {type_name(parallel)}",
                           param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return None
    tool_format = resolve_tool_format(tool_format, family or "")
    if tool_format == "none":
        raise RequestError("tools are off for this model: a Llama 2 checkpoint has no tool-calling format, or the "
                           "yaml's handler.tool_format is none", param="tools")
    if (tool_format == "llama4_pythonic") != (family == "llama4"):
        raise RequestError(f"tools: the yaml's handler.tool_format {tool_format} does not fit this {family} checkpoint "
                           "(Llama 4 calls in llama4_pythonic, Llama 3 in llama3_json or pythonic); set auto",
                           param="tools")
    try:
        tool_functions(tools)
    except ValueError as exc:
        raise RequestError(f"tools: {exc}", param="tools") from None
    choice = "auto" if choice is None else choice
    if not (choice in ("none", "auto", "required") or _named(choice)):
        raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                           '{"name": ...}}', param="tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise RequestError(f"tool_choice names {choice['function']['name']!r}, which is not among the tools {names}",
                           param="tool_choice")
    if parallel and fmt_allows_one(tool_format):
        raise RequestError(f"parallel_tool_calls: the {tool_format} format carries one call per reply (Meta's "
                           "Llama 3.1 format); send false or leave it out", param="parallel_tool_calls")
    return ToolUse(tools, choice, tool_format, parallel is not False and not fmt_allows_one(tool_format))


def reply_constraint(body: dict[str, Any], tools: ToolUse | None, ignore_eos: bool) -> GrammarSpec | None:
    """The reply's grammar: response_format / structured_outputs, or the tools' calls (not both)."""
    grammar = constrained_reply(body, ignore_eos)
    if tools is None or tools.choice == "none":
        return grammar
    if grammar is not None:
        raise RequestError(f"send either tools (with tool_choice other than none) or {grammar.param}, not both",
                           param=grammar.param)
    if ignore_eos:
        raise RequestError("ignore_eos cannot be combined with tools: a call ends with the end-of-sequence token",
                           param="ignore_eos")
    return tools.grammar


def chat_ids(body: dict[str, Any], messages: Any, tokenizer: ChatTokenizer, tool_format: str) -> tuple[list[int], ToolUse | None]:
    """A chat's prompt ids, in the tool-calling prompt when the request sends tools, and its tools."""
    tools = tool_use(body, tool_format, getattr(tokenizer, "family", None))
    return (tools.prompt_ids(messages, tokenizer) if tools else chat_prompt_ids(messages, tokenizer)), tools


def fmt_allows_one(tool_format: str) -> bool:
    return tool_format == "llama3_json"


def _named(choice: Any) -> bool:
    return (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str))


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(eq=False)
class ToolReply:
    """One choice's reply under tools: text until it starts a call, then its calls (streamed as deltas)."""

    use: ToolUse
    text: str = ""
    is_call: bool | None = None  # None: not decided yet (only whitespace so far)
    sent: int = 0  # characters of the text already handed out (as content, or scanned into calls)
    calls: list[dict] = field(default_factory=list)  # the calls streamed so far: id, name, arguments sent

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        """New shown text in; (content to stream, OpenAI tool-call deltas to stream) out."""
        self.text += piece
        if self.is_call is None:
            head = self.text.lstrip(CALL_SPACE)  # "\xa0[" starts text: free under "auto", never read as a call
            if not head:
                return "", []
            self.is_call = head[0] in "{[" or head.startswith(PYTHON_TAG) or self.use.choice not in ("auto", "none")
            if self.use.choice == "none":
                self.is_call = False
        if not self.is_call:
            content, self.sent = self.text[self.sent :], len(self.text)
            return content, []
        return "", self._call_deltas()

    def flush(self) -> str:
        """At the end of a streamed reply: text held while undecided (only whitespace) goes out as content."""
        if self.is_call is None:
            self.is_call, self.sent = False, len(self.text)
            return self.text
        return ""

    def cut_call(self) -> str:
        """At the end of a streamed chat reply: a call cut short (it does not parse) whose name never went out
        goes out as content, as the whole reply gives it (held from its first character, none of it went out
        before). Once a call's delta went out the stream cannot take it back: the cut call stays the calls sent,
        their arguments as far as they were written, with the cut's finish_reason ("length", or "stop" for a stop
        string), as vLLM streams one."""
        if self.is_call and not self.calls and not self.finished_as_call:
            self.is_call, self.sent = False, len(self.text)
            return self.text
        return ""

    @property
    def finished_as_call(self) -> bool:
        """The whole reply parses as calls to the given tools (a reply cut short does not)."""
        return self.finish()[2]

    def finish(self, text: str | None = None) -> tuple[str | None, list[dict], bool]:
        """At the end (`text`: the whole reply, when it was not fed piece by piece): (content, the calls as
        OpenAI's message.tool_calls, whether the reply is a call)."""
        if text is not None:
            self.text = text
        calls = None
        if self.is_call is not False and self.use.choice != "none":
            calls = parse_tool_calls(self.text, self.use.fmt, self.use.tools)
        if calls is None:
            return self.text, [], False
        out = []
        for i, call in enumerate(calls):
            call_id = self.calls[i]["id"] if i < len(self.calls) else _call_id()
            out.append({"id": call_id, "type": "function",
                        "function": {"name": call["name"], "arguments": _arguments(self, i, call)}})
        return None, out, True

    def _call_deltas(self) -> list[dict]:
        """Deltas for what the text now holds: a call's index, id and name once its name is complete, then its
        arguments as they grow (llama3_json: the raw JSON as generated; pythonic: each call's arguments
        whole, once its closing parenthesis arrives, as they must be rewritten from Python to JSON)."""
        deltas = []
        for i, (name, arguments, whole) in enumerate(_scan_calls(self.text, self.use)):
            if i == len(self.calls):
                if name is None:
                    break
                self.calls.append({"id": _call_id(), "name": name, "sent": 0})
                deltas.append({"index": i, "id": self.calls[i]["id"], "type": "function",
                               "function": {"name": name, "arguments": ""}})
            state = self.calls[i]
            if arguments is not None and len(arguments) > state["sent"] and (whole or self.use.fmt == "llama3_json"):
                deltas.append({"index": i, "function": {"arguments": arguments[state["sent"] :]}})
                state["sent"] = len(arguments)
        return deltas


def _arguments(reply: ToolReply, i: int, call: dict) -> str:
    """A call's arguments as the JSON string the stream sent (llama3_json: the model's own JSON text)."""
    if reply.use.fmt == "llama3_json":
        scanned = _scan_calls(reply.text, reply.use)
        if i < len(scanned) and scanned[i][2]:
            return scanned[i][1]
    return json.dumps(call["arguments"], ensure_ascii=False)


def _scan_calls(text: str, use: ToolUse) -> list[tuple[str | None, str | None, bool]]:
    """(name, arguments so far, complete) per call in a partial reply."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    if use.fmt == "llama3_json":
        return [_scan_json_call(body)]
    calls, depth, start, quote, escaped = [], 0, 1, None, False
    for at, char in enumerate(body[1:], start=1):  # past "["
        if quote:
            escaped, quote = (not escaped and char == "\\"), (None if char == quote and not escaped else quote)
            continue
        if char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0 and char == ")":
                parsed = parse_tool_calls("[" + body[start : at + 1].strip(", ") + "]", "pythonic", use.tools) or []
                calls.append((parsed[0]["name"], json.dumps(parsed[0]["arguments"], ensure_ascii=False), True)
                             if parsed else (None, None, False))
                start = at + 1
    open_name = body[start:].strip(", ").partition("(")
    if open_name[1] and open_name[0].isidentifier():
        calls.append((open_name[0], None, False))
    return calls


def _scan_json_call(body: str) -> tuple[str | None, str | None, bool]:
    """The name and the raw `parameters` JSON so far of a partial llama3_json call."""
    name, after = None, 0
    at = body.find('"name"')
    if at >= 0:
        rest = body[at + 6 :].lstrip(" \n\t:")
        whole = _JSON_STRING.match(rest)  # to its closing quote: a name may hold an escaped one
        if whole:
            name, after = json.loads(whole.group()), len(body) - len(rest) + whole.end()
    at = body.find('"parameters"', after)  # past the name, which may itself be "parameters"
    if name is None or at < 0:
        return name, None, False
    rest = body[at + 12 :].lstrip(" \n\t:")
    depth, quote, escaped = 0, False, False
    for i, char in enumerate(rest):
        if quote:
            escaped, quote = (not escaped and char == "\\"), not (char == '"' and not escaped)
        elif char == '"':
            quote = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return name, rest[: i + 1], True
    return name, rest, False
