"""Hostile bodies for the Responses API and the tokenizer endpoints: valid requests made invalid one field at
a time (wrong types, wrong shapes, hosted tools, media parts, state the server does not keep), each of which
must be refused with a 400. Labels come from how a body was made, not from the handler's code."""

from __future__ import annotations

import json
from typing import Any

BASE = {"input": "hi", "max_output_tokens": 4}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
# Values refused in each field, whatever their neighbours (a type the field never takes, or a value out of range).
BAD_FIELDS: dict[str, list[Any]] = {
    "input": [None, 1, True, {}, [], [None], ["hi"], [[]], {"role": "user"}],
    "instructions": [1, [], {}, True],
    "max_output_tokens": [0, -1, 1.5, "4", True, 10**9, [4]],
    "temperature": [-1, "0", [], True, -1e308],
    "top_p": [0, -0.5, 1.5, "1", {}],
    "seed": [-1, 2**64, 1.5, "1"],
    "top_logprobs": [-1, 21, 1.5, "2", True],
    "stream": [1, "true", [], {}],
    "include": ["message.output_text.logprobs", [1], ["file_search_call.results"], {}, True],
    "text": ["json", 1, [], {"format": "json"}, {"format": {"type": "json_schema"}},
             {"format": {"type": "json_schema", "name": "n"}}, {"format": {"type": "json_object", "x": 1}},
             {"format": {"type": "json_schema", "name": 1, "schema": {}}}, {"verbosity": "low"}, {"x": 1}],
    "tools": ["f", 1, {}, [None], [1], [{"type": "web_search"}], [{"type": "file_search"}], [{"type": "mcp"}],
              [{"type": "code_interpreter"}], [{"type": "image_generation"}], [{"type": "function"}],
              [{"type": "function", "name": ""}], [{**TOOL, "parameters": []}], [{**TOOL, "strict": "yes"}],
              [{**TOOL, "description": 1}], [{**TOOL, "defer_loading": True}], [TOOL, TOOL],
              [{**TOOL, "parameters": {"properties": []}}]],
    "tool_choice": ["always", 1, [], {"type": "function"}, {"type": "web_search"}, {"name": "f"}, "required"],
    "parallel_tool_calls": ["yes", 1, []],
    "metadata": ["x", [], {"k": 1}],
    "user": [1, [], {}],
    "store": ["yes", 1],
    "truncation": ["auto", 1, True],
    "previous_response_id": ["resp_1", 1],
    "conversation": ["conv_1", {"id": "conv_1"}],
    "reasoning": [{"effort": "high"}, {}, "low"],
    "background": [True, "yes"],
    "prompt": [{"id": "pmpt_1"}],
    "max_tool_calls": [1],
    "service_tier": ["flex", 1],
    "stream_options": [{"include_obfuscation": False}, "x"],
    "model": [1, [], {}],
    "stop": ["x"],
    "messages": [[{"role": "user", "content": "hi"}]],
    "max_tokens": [4],
}
BAD_ITEMS: list[Any] = [
    {"role": "user"}, {"role": "user", "content": None}, {"role": "user", "content": 1},
    {"role": "robot", "content": "x"}, {"role": "tool", "content": "x"}, {"role": ["user"], "content": "x"},
    {"role": "user", "content": [{"type": "text", "text": "x"}]}, {"role": "user", "content": ["x"]},
    {"role": "user", "content": [{"type": "input_text"}]}, {"role": "user", "content": [{"type": "input_text", "text": 1}]},
    {"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]},
    {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
    {"role": "user", "content": "x", "name": "n"}, {"type": "message", "role": "user", "content": [None]},
    {"type": "function_call", "name": "f", "arguments": "{}"}, {"type": "function_call", "call_id": "c", "arguments": "{}"},
    {"type": "function_call", "call_id": "c", "name": "f", "arguments": {}},
    {"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c", "output": "x"},
    {"type": "function_call_output", "output": "x"}, {"type": "item_reference", "id": "msg_1"},
    {"type": "reasoning", "summary": []}, {"type": "web_search_call", "id": "w"}, {"type": "computer_call_output"},
    {"type": "mcp_call"}, {"type": "nonsense"}, {"type": 1},
]


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", errors="surrogatepass")


def hostile_responses() -> list[bytes]:
    """Bodies for POST .../v1/responses that must each be a 400."""
    bodies = [_json({**BASE, key: value}) for key, values in BAD_FIELDS.items() for value in values]
    bodies += [_json({**BASE, "input": [{"role": "user", "content": "hi"}, item]}) for item in BAD_ITEMS]
    bodies += [_json({**BASE, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                        {"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}]}),
               _json({**BASE, "tool_choice": "auto"}),  # a choice without tools
               _json({**BASE, "input": "hi " * 5000}),  # past max_seq_len
               _json({"input": "hi", "max_output_tokens": 4, "text": {"format": {
                   "type": "json_schema", "name": "s", "schema": "not a schema"}}})]
    return bodies


def hostile_tokenizer_bodies() -> list[tuple[str, bytes]]:
    """(path, body) for the tokenizer endpoints that must each be a 400."""
    tokenize = [{}, {"prompt": 1}, {"prompt": None}, {"prompt": ["a"]}, {"prompt": "a", "messages": []},
                {"prompt": "a", "add_special_tokens": "yes"}, {"prompt": "a", "return_token_strs": 1},
                {"prompt": "a", "extra": 1}, {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "x"}]},
                {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False},
                {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
                {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
                {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": "yes"}]
    detokenize = [{}, {"tokens": None}, {"tokens": "1 2"}, {"tokens": [1.5]}, {"tokens": [True]}, {"tokens": [-1]},
                  {"tokens": [10**12]}, {"tokens": [[1]]}, {"tokens": [1], "extra": 1}, {"prompt": "x"}]
    raw = [b"", b"{", b"null", b"[]", b'"x"', b"\xff", b'{"prompt": "a", "prompt": "b"}', b'{"prompt": "\\ud800"}']
    return ([("tokenize", _json(body)) for body in tokenize] + [("detokenize", _json(b)) for b in detokenize]
            + [(path, body) for path in ("tokenize", "detokenize") for body in raw])
