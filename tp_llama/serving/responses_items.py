"""The Responses API's request shapes in the shapes the chat machinery reads: `input` items into chat
messages, flat function `tools` and `tool_choice` into chat's nested ones, `text.format` into a
`response_format`.

The chat path then builds the prompt, the tools' grammar and the structured-output grammar exactly as
it does for /v1/chat/completions, so a conversation gets the same prompt tokens through either API.
Every item is checked here first, so a refusal names its place in `input` rather than in the chat
messages it becomes.
"""

from __future__ import annotations

import json
from typing import Any

from tp_llama.serving.request import RequestError, client_json, json_object, type_name

TEXT_PARTS = ("input_text", "output_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
_PART_KEYS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"},
              "refusal": {"type", "refusal"}}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
# Item types that only stored state can give meaning to, and those of hosted tools or reasoning models.
_STATEFUL_ITEMS = ("item_reference",)
_NOT_TEXT_ITEMS = ("reasoning", "web_search_call", "file_search_call", "computer_call", "computer_call_output",
                   "code_interpreter_call", "image_generation_call", "local_shell_call", "local_shell_call_output",
                   "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output", "mcp_list_tools",
                   "mcp_approval_request", "mcp_approval_response", "mcp_call", "custom_tool_call",
                   "custom_tool_call_output", "compaction", "tool_search_call", "tool_search_output")


def _refuse(message: str, param: str = "input") -> RequestError:
    return RequestError(message, param=param)


def _string(value: Any, where: str, param: str = "input") -> str:
    if not isinstance(value, str):
        raise _refuse(f"{where} must be a string, got {type_name(value)}", param)
    return value


def _no_extra(item: dict, allowed: set[str], where: str) -> None:
    """Unknown fields are refused; a null one is a field left out (as clients dumping their models send)."""
    extra = sorted(key for key in set(item) - allowed if item[key] is not None)
    if extra:
        raise _refuse(f"{where} has unknown field(s) {extra}; allowed: {sorted(allowed)}")


def _text_of(content: Any, where: str) -> str | tuple[str, ...]:
    """A message's or a call output's content: a string, or its text parts, which the chat templates encode each on
    its own as Meta's ChatFormat does (chat's parts alike: openai_api.chat_messages); images, files and audio
    refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(f"{where} must be a string or an array of content parts, got {type_name(content)}")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) and isinstance(part.get("type"), str) else None
        if kind in MEDIA_PARTS:
            raise _refuse(f"{at}: {kind} parts are not supported: this server runs a text model")
        if kind not in _PART_KEYS:
            raise _refuse(f"{at} must be a text part ({', '.join(TEXT_PARTS)} or refusal), got "
                          f"{kind if isinstance(kind, str) else type_name(part)!r}")
        _no_extra(part, _PART_KEYS[kind], at)
        texts.append(_string(part.get("refusal" if kind == "refusal" else "text"), f"{at}.text"))
    return tuple(texts)


def _message(item: dict, where: str) -> dict:
    _no_extra(item, _MESSAGE_KEYS, where)
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise _refuse(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}")
    return {"role": ROLES[role], "content": _text_of(item.get("content"), f"{where}.content")}


def _call(item: dict, where: str) -> dict:
    """A function_call item the client sends back: chat's tool_calls entry."""
    _no_extra(item, _CALL_KEYS, where)
    call_id = _string(item.get("call_id"), f"{where}.call_id")
    name = _string(item.get("name"), f"{where}.name")
    arguments = _string(item.get("arguments"), f"{where}.arguments")
    if not call_id or not name:
        raise _refuse(f"{where}: call_id and name must not be empty")
    # Read here, so that a refusal names the item rather than the chat message it becomes.
    json_object(client_json(arguments or "{}", f"{where}.arguments", "input", syntax="is not JSON: {error}"),
                f"{where}.arguments", "input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def input_messages(items: Any, instructions: Any, with_tools: bool) -> list[dict]:
    """`instructions` and `input` as chat messages: leading system and developer messages join the
    instructions in one system message (the prompt formats take one, first); consecutive
    function_call items are one assistant turn of calls (which need `tools`: they are written in the
    tools' format); a function_call_output is a tool message."""
    system = [] if instructions is None else [_string(instructions, "instructions", "instructions")]
    if isinstance(items, str) and items:
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _refuse(f"input must be a non-empty string or a non-empty array of items, got {type_name(items)}")
    messages: list[dict] = []
    calls: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _refuse(f"{where} must be an object, got {type_name(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, where)
            if message["role"] == "system" and not messages:  # one system text: its parts joined
                system.append("".join(message["content"]))
            else:
                messages.append(message)
        elif kind == "function_call":
            call = _call(item, where)
            if not with_tools:
                raise _refuse(f"{where}: function_call items need the request's tools, in whose format the calls "
                              "are written into the prompt")
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _no_extra(item, _OUTPUT_KEYS, where)
            call_id = _string(item.get("call_id"), f"{where}.call_id")
            if call_id not in calls:
                raise _refuse(f"{where}: no function_call item before it has call_id {call_id!r} (this server "
                              "stores nothing: send the call with its output)")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind in _STATEFUL_ITEMS:
            raise _refuse(f"{where}: {kind} needs stored items, and this server stores none: send the items")
        elif kind in _NOT_TEXT_ITEMS:
            raise _refuse(f"{where}: {kind} items are not supported: this server answers with messages and "
                          "function calls")
        else:
            raise _refuse(f"{where}.type must be message, function_call or function_call_output, got {kind!r}")
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


def chat_tools(tools: Any) -> list[dict] | None:
    """Flat function tools ({"type": "function", "name", "description", "parameters", "strict"}) in
    chat's nested shape; hosted tools are refused, naming their type."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _refuse(f"tools must be an array, got {type_name(tools)}", "tools")
    nested = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _refuse(f"{where}: {kind!r} tools are not supported: this server runs only function tools "
                          "(hosted tools such as web search, file search and code interpreter live on OpenAI's "
                          "platform)" if isinstance(kind, str) else f"{where} must be a function tool object", "tools")
        extra = sorted(key for key in set(tool) - _TOOL_KEYS if tool[key] is not None)
        if extra:
            raise _refuse(f"{where} has unknown field(s) {extra}; allowed: {sorted(_TOOL_KEYS)}", "tools")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _refuse(f"{where}.name must be a non-empty string", "tools")
        for key, kinds in (("description", str), ("strict", bool), ("parameters", dict)):
            if tool.get(key) is not None and not isinstance(tool[key], kinds):
                raise _refuse(f"{where}.{key} must be a {type_name(kinds())}, got {type_name(tool[key])}", "tools")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters.get("properties", {}), dict):
            raise _refuse(f"{where}.parameters.properties must be an object", "tools")
        try:  # the reply echoes the tools, and a number past float's range (1e999) is no JSON there
            json.dumps(tool, allow_nan=False)
        except ValueError:
            raise _refuse(f"{where} holds a number out of range (past float's, as 1e999 is)", "tools") from None
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        nested.append({"type": "function", "function": function})
    return nested


def chat_tool_choice(choice: Any) -> str | dict | None:
    """"none", "auto", "required" or {"type": "function", "name"} in chat's shape."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and set(choice) == {"type", "name"} and isinstance(choice["name"], str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(kind, str) and kind != "function":
        raise _refuse(f"tool_choice of type {kind!r} is not supported: send \"none\", \"auto\", \"required\" or "
                      "{\"type\": \"function\", \"name\": ...}", "tool_choice")
    raise _refuse('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                  "tool_choice")


def chat_response_format(text: Any) -> dict | None:
    """`text.format` ({"type": "text"}, {"type": "json_object"} or the flat {"type": "json_schema", "name",
    "schema", "strict", "description"}) as chat's `response_format`."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _refuse(f"text must be an object, got {type_name(text)}", "text")
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise _refuse(f"text has unknown field(s) {extra}; allowed: format", "text")
    if text.get("verbosity") is not None:
        raise _refuse("text.verbosity is not supported: the model is not told how long to answer; use "
                      "max_output_tokens", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return dict(fmt)  # response_format refuses any other field of these two
    if kind != "json_schema":
        raise _refuse(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text")
    if not isinstance(fmt.get("name"), str):
        raise _refuse("text.format.name must be a string", "text")
    spec = {key: value for key, value in fmt.items() if key != "type"}
    return {"type": "json_schema", "json_schema": spec}
