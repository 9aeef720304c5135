"""Meta's tool-calling prompts for Llama 3.x and 4: an OpenAI chat history with tools as prompt ids.

Three formats, named as vLLM names its parsers:

- ``llama3_json`` (Llama 3.1 / 3.3): the model answers one call per reply, as a JSON object
  ``{"name": ..., "parameters": {...}}`` (Meta's own encoding adds ``"type": "function"`` first,
  and the model may put ``<|python_tag|>`` before it); tool results come back in the ``ipython``
  role. The system prompt says "Environment: ipython" (``ipython=True``, the default, as Meta's
  generators write it whenever there are tools), and only then does a call end with ``<|eom_id|>``.
- ``pythonic`` (Llama 3.2): the model answers a Python list of calls,
  ``[get_weather(city="Paris"), other(n=[1, 2])]``; every turn ends with ``<|eot_id|>``.
- ``llama4_pythonic`` (Llama 4): the same list, ending ``<|eot|>``, after Llama 4's own system prompt
  of rules (llama4_format.py, from Meta's Llama 4 prompt format); the turns are framed as
  ``llama_models.llama4.chat_format.ChatFormat`` frames them: ``<|header_start|>`` headers, text as
  sent, tool results in the ``ipython`` role ending ``<|eom|>``, and an earlier assistant turn that
  made calls ending ``<|eom|>`` too, as ChatFormat writes one (the model itself ends a call ``<|eot|>``).

The texts are those of Meta's prompt generators in llama-models (``JsonCustomToolGenerator``,
``PythonListCustomToolGenerator``, the system prompt of its Llama 3.1 prompt guide) and the turns
are framed as ``llama_models.llama3.chat_format.ChatFormat`` frames them; tests/test_tool_format.py
checks both token for token (tests/test_llama4_tokenizer.py the Llama 4 format). Where Meta's templates
write a string raw (a description holding a quote) this module writes it JSON-escaped, and a missing
description is empty rather than "None".
"""

from __future__ import annotations

import json
import math
from datetime import datetime

from tp_llama.json_schema import check_has_instance
from tp_llama.llama4_format import LLAMA4_TOOLS_HEAD
from tp_llama.tokenizer import TiktokenBase, Tokenizer

TOOL_FORMATS = ("llama3_json", "pythonic", "llama4_pythonic")

_JSON_TOOLS_HEAD = (
    "Answer the user's question by making use of the following functions if needed.\n"
    "If none of the function can be used, please say so.\n"
    "Here is a list of functions in JSON format:\n"
)
_JSON_TOOLS_TAIL = "\nReturn function calls in JSON format."
_PYTHONIC_HEAD = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the function can be used, point it out. If the given question lacks the parameters required "
    "by the function,\nalso point it out. You should only return the function call in tools call sections.\n\n"
    "If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "You SHOULD NOT include any other text in the response.\n\n"
    "Here is a list of functions in JSON format that you can invoke.\n\n"
)


def check_tool_format(tool_format: str) -> None:
    """Raise ValueError unless ``tool_format`` is one this module writes, naming the choices."""
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")


def is_string_list(value: object) -> bool:
    """A JSON array of strings, as a schema's `required` (and a list `type`) must be."""
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def tool_functions(tools: list[dict] | None) -> list[dict]:
    """The ``function`` objects of OpenAI ``tools``, checked, with description and parameters filled in.

    Checked once here so that the prompt, the parser and the grammar agree on the same names.
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        function = tool["function"]
        name, params = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if name in names:
            raise ValueError(f"tools[{i}]: two tools are named {name!r}")
        if params is None:
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict) or not isinstance(params.get("properties", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object with 'properties'")
        if not is_string_list(params.get("required", [])):
            raise ValueError(f"tools[{i}].function.parameters.required must be an array of strings")
        check_has_instance(params, f"tools[{i}].function.parameters")
        names.add(name)
        functions.append({"name": name, "description": function.get("description") or "", "parameters": params})
    return functions


def chosen_function(tool_choice: str | dict, functions: list[dict]) -> str | None:
    """The name a named ``tool_choice`` forces, None for "auto" / "none" / "required"."""
    if tool_choice in ("auto", "none", "required"):
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice must be 'auto', 'none', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    if name not in {f["name"] for f in functions}:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")
    return name


def py_literal(value: object) -> str:
    """``value`` (JSON data) as a Python literal, the way a pythonic call writes its arguments.

    Strings are double-quoted and escaped, so a value with a quote still parses back; Meta's
    encoder writes them raw, and a dict as ``{k=v}``, which no parser reads.
    """
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return "{" + ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"{value!r} is not JSON data a pythonic call can carry")


def _encode_call(name: str, arguments: dict, tool_format: str) -> str:
    """One assistant tool call as the model writes it, so a history reads like the model's own replies."""
    if tool_format == "llama3_json":
        return json.dumps({"type": "function", "name": name, "parameters": arguments})
    return f"{name}(" + ", ".join(f"{k}={py_literal(v)}" for k, v in arguments.items()) + ")"


def encode_tool_chat(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    tool_format: str,
    *,
    tool_choice: str | dict = "auto",
    ipython: bool = True,
    today: str | None = None,
) -> list[int]:
    """The prompt ids of an OpenAI chat history with tools, ending where the assistant replies.

    Where the tool definitions go follows Meta's code for each format. ``llama3_json``: the
    system prompt holds only "Environment: ipython", the knowledge and today's dates and the
    caller's system message; the definitions (JsonCustomToolGenerator's text) are a user turn of
    their own right after it, before the conversation, because that is where Meta's Llama 3.1
    prompt guide and llama-stack put custom tools ("Instructions for tools added as a user
    message"). ``pythonic``: the definitions (PythonListCustomToolGenerator's text) open the
    system prompt and the caller's system message follows them, as llama-stack appends it for
    Llama 3.2. ``llama4_pythonic``: as ``pythonic``, the definitions after Llama 4's rules. A required
    or named ``tool_choice`` adds llama-stack's one-line instruction to the system prompt. ``today``
    ("21 September 2024") defaults to the current date, as Meta's does.
    ``ipython=False`` leaves out "Environment: ipython" (llama3_json), and calls then end <|eot_id|>.
    Assistant ``tool_calls`` are written as Meta's ``encode_tool_call`` writes them (a pythonic
    message's calls as one list), and ``tool`` messages become the ``ipython`` role.
    """
    if not isinstance(tokenizer, TiktokenBase):
        raise ValueError(f"tools need a Llama 3 checkpoint (or a Llama 4 one: a tiktoken tokenizer.model); this "
                         f"one is {getattr(tokenizer, 'family', type(tokenizer).__name__)}")
    check_tool_format(tool_format)
    if (tokenizer.family == "llama4") != (tool_format == "llama4_pythonic"):
        raise ValueError(f"tool_format {tool_format!r} is not a {tokenizer.family} format: Llama 4 calls in "
                         "llama4_pythonic, Llama 3 in llama3_json or pythonic")
    functions = tool_functions(tools)
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    system = None
    if isinstance(messages[0], dict) and messages[0].get("role") == "system":
        system = "".join(_text(messages[0], 0))
    choice = _choice_line(tool_choice, functions)
    eom = tool_format == "llama3_json" and ipython and bool(functions)
    eot = tokenizer.end_of_turn
    # Meta's Llama 4 ChatFormat ends both a turn that made calls and a tool result <|eom|>.
    call_end, result_end = ("<|eom|>",) * 2 if tool_format == "llama4_pythonic" else ("<|eom_id|>" if eom else eot, eot)
    if tool_format == "llama3_json":
        env = "Environment: ipython\n\n" if eom else ""
        today = today or datetime.now().strftime("%d %B %Y")
        head = f"{env}Cutting Knowledge Date: December 2023\nToday Date: {today}"
        turns = [("system", head + (f"\n\n{system}" if system else "") + choice + "\n")]
        if functions:
            turns.append(("user", _JSON_TOOLS_HEAD + "".join(_json_tool(f) + "\n" for f in functions)
                          + _JSON_TOOLS_TAIL))
    else:
        head = LLAMA4_TOOLS_HEAD if tool_format == "llama4_pythonic" else _PYTHONIC_HEAD
        text = head + _pythonic_tools(functions) + "\n" if functions else ""
        text = (text + (system or "") + choice).strip("\n")
        turns = [("system", text)] if text else []
    ids = [tokenizer.bos_id]
    for role, text in turns:
        ids += _turn(tokenizer, role, [text], eot)
    for i, message in enumerate(messages[1:] if system is not None else messages, start=int(system is not None)):
        ids += _message(tokenizer, message, i, tool_format, call_end, result_end)
    return ids + tokenizer._header("assistant")


def _choice_line(tool_choice: str | dict, functions: list[dict]) -> str:
    """llama-stack's instruction for a forced choice; the grammar enforces it, this tells the model why."""
    name = chosen_function(tool_choice, functions)
    if name is not None:
        return f"\nYou MUST use the tool `{name}` to answer the user query."
    if tool_choice == "required":
        return "\nYou MUST use one of the provided functions/tools to answer the user query."
    return ""


def _message(tokenizer: TiktokenBase, message: object, i: int, tool_format: str, call_end: str,
             result_end: str) -> list[int]:
    """One history message: user and tool turns as text, assistant turns with their calls; a turn with
    calls ends ``call_end``, a tool result ``result_end``, any other the family's end of turn."""
    if not isinstance(message, dict):
        raise ValueError(f"message {i} must be a dict, got {type(message).__name__}")
    role, eot = message.get("role"), tokenizer.end_of_turn
    if role == "user":
        return _turn(tokenizer, "user", _text(message, i), eot)
    if role == "tool":
        return _turn(tokenizer, "ipython", _text(message, i), result_end)
    if role != "assistant":
        raise ValueError(f"message {i}: role must be 'user', 'assistant' or 'tool' (a system message "
                         f"only comes first), got {role!r}")
    calls = _calls(message, i)
    content = [] if message.get("content") is None and calls else _text(message, i)
    if not calls:
        return _turn(tokenizer, "assistant", content, eot)
    if tool_format == "llama3_json":
        if len(calls) > 1:
            raise ValueError(f"message {i}: llama3_json carries one tool call per assistant message "
                             f"(Meta's Llama 3.1 format), got {len(calls)}")
        return _turn(tokenizer, "assistant", [*content, _encode_call(*calls[0], tool_format)], call_end)
    listed = "[" + ", ".join(_encode_call(name, args, tool_format) for name, args in calls) + "]"
    return _turn(tokenizer, "assistant", [*content, listed], call_end)


def _calls(message: dict, i: int) -> list[tuple[str, dict]]:
    """(name, arguments) of an assistant message's OpenAI ``tool_calls``; arguments arrive as a JSON string."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError(f"message {i}: tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"message {i}: tool_calls[{j}] must be {{'type': 'function', 'function': "
                             "{'name', 'arguments'}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as err:
                raise ValueError(f"message {i}: tool_calls[{j}].function.arguments is not JSON: {err}") from err
        if not isinstance(arguments, dict):
            raise ValueError(f"message {i}: tool_calls[{j}].function.arguments must be a JSON object")
        out.append((name, arguments))
    return out


def _text(message: dict, i: int) -> list[str]:
    """A message's text parts: a str is one, a tuple (the OpenAI API's text parts) one each, encoded apart."""
    content = message.get("content")
    parts = content if isinstance(content, tuple) else (content,)
    if not all(isinstance(part, str) for part in parts):
        raise ValueError(f"message {i}: content must be a str, got {type(content).__name__}")
    return list(parts)


def _turn(tokenizer: TiktokenBase, role: str, pieces: list[str], end: str) -> list[int]:
    """A header, then each piece encoded on its own as Meta's ChatFormat does, then the end token."""
    ids = tokenizer._header(role)
    for piece in pieces:
        ids += tokenizer.encode(piece, bos=False)
    return ids + [tokenizer.special_ids[end]]


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _required(params: dict) -> str:
    """The required names in property order, as Meta's generators list them."""
    required = set(params.get("required") or [])
    return json.dumps([name for name in params.get("properties", {}) if name in required])


def _json_tool(function: dict) -> str:
    """One tool as JsonCustomToolGenerator writes it: every parameter typed "object", as Meta's does."""
    params = function["parameters"]
    props = ",".join(
        "\n                {\n"
        f"                    {_quote(name)}: {{\n"
        '                        "type": "object",\n'
        f"                        \"description\": {_quote(_description(schema))}\n"
        "                    }\n"
        "                }"
        for name, schema in params.get("properties", {}).items()
    )
    return (
        "{\n"
        '    "type": "function",\n'
        '    "function": {\n'
        f'        "name": {_quote(function["name"])},\n'
        f'        "description": {_quote(function["description"])},\n'
        '        "parameters": {\n'
        '            "type": "object",\n'
        f'            "properties": [{props}\n'
        "            ],\n"
        f'            "required": {_required(params)}\n'
        "        }\n"
        "    }\n"
        "}"
    )


def _pythonic_tools(functions: list[dict]) -> str:
    """The tools as PythonListCustomToolGenerator lists them: name, description, typed parameters."""
    blocks = []
    for function in functions:
        params = function["parameters"]
        props = ",".join(
            f"\n                {_quote(name)}: {{\n"
            f'                    "type": {_quote(_type_name(schema))},\n'
            f'                    "description": {_quote(_description(schema))}'
            + (f',\n                    "default": {_quote(str(schema["default"]))}'
               if isinstance(schema, dict) and schema.get("default") else "")
            + "\n                }"
            for name, schema in params.get("properties", {}).items()
        )
        blocks.append(
            "{\n"
            f'        "name": {_quote(function["name"])},\n'
            f'        "description": {_quote(function["description"])},\n'
            '        "parameters": {\n'
            '            "type": "dict",\n'
            f'            "required": {_required(params)},\n'
            f'            "properties": {{{props}\n'
            "            }\n"
            "        }\n"
            "    }"
        )
    return "[\n    " + ",\n    ".join(blocks) + "\n]"


def _description(schema: object) -> str:
    description = schema.get("description") if isinstance(schema, dict) else None
    return description if isinstance(description, str) else ""


def _type_name(schema: object) -> str:
    """A parameter's JSON schema type as the prompt names it; a union is joined, no type is "any"."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        return " or ".join(str(k) for k in kind)
    return kind if isinstance(kind, str) else "any"
