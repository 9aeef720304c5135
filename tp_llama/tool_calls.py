"""Reading tool calls out of a Llama 3.x or 4 reply, and the llguidance grammar that makes a reply a valid call.

What each format allows (tool_format.py writes the prompts):

- ``llama3_json``: exactly one call per reply, ``{"name": ..., "parameters": {...}}``, optionally
  with ``"type": "function"`` first and ``<|python_tag|>`` before it. Meta's Llama 3.1 guide
  supports a single call per reply in this format, so ``parallel`` changes nothing here.
- ``pythonic``: a Python list of calls with keyword arguments, ``[f(a=1), g(b="x")]``: 1 to
  MAX_CALLS calls when ``parallel`` is true, exactly one when false.
- ``llama4_pythonic``: the same list, as Llama 4 writes it bare; read back also wrapped in
  ``<|python_start|>`` / ``<|python_end|>`` and followed by ``<|eot|>`` or ``<|eom|>``, the
  markers Meta's Llama 4 ChatFormat drops when it decodes a reply.

The grammar is Lark for llguidance. JSON calls embed each tool's ``parameters`` schema with
``%json``, so llguidance itself enforces every JSON schema feature it supports and rejects the rest
when it compiles. Pythonic arguments are Python literals, not JSON (``True``, ``None``), so their
structure (objects, arrays, enums, unions, ``$ref``) is written here, and strings and numbers, which
read the same in both, are left to ``%json`` leaves; a schema keyword this translation does not
enforce raises ValueError naming it and its path, never a silently looser grammar.
"""

from __future__ import annotations

import ast
import json
import keyword
import math

from tp_llama.tool_format import check_tool_format, chosen_function, is_string_list, py_literal, tool_functions

# Around JSON tokens: one space, or line breaks and an indent, as llama.cpp's JSON grammars
# bound it: room for the indented calls of Meta's guide, none for padding a call forever.
JSON_WHITESPACE = r"( |\n{1,2}[ \t]{0,20})?"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
# Python reads these JSON escapes to the same characters; \uXXXX could spell a lone surrogate.
_PY_STRING_OPTIONS = {"json_allowed_escapes": 'nrbtf\\"'}
_CALL_START = r"[ \t\n\r]*(\{|\[|<\|python_tag\|>)(?s:.*)"
_TEXT_RULE = f"TEXT: /(?s:.*)/ & ~/{_CALL_START}/"
_SPACE = " \t\n\r"
MAX_CALLS = 8  # a pythonic reply's calls at most: a list without end would run to max_tokens, never a call
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                "writeOnly", "$schema", "$id", "$defs", "definitions"}
_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "array": {"items", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties"},
    "boolean": set(),
    "null": set(),
}
_KNOWN = _ANNOTATIONS | {"type", "enum", "const", "anyOf", "oneOf", "$ref"}.union(*_KEYWORDS.values())
_PY_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
             "null": (type(None),), "array": (list,), "object": (dict,)}


def parse_tool_calls(text: str, tool_format: str, tools: list[dict] | None) -> list[dict] | None:
    """The calls in a finished reply, [{"name", "arguments": dict}], or None when it is not a call.

    None also for a call that does not parse or names no given tool, so that the reply goes back
    as text rather than as a call the client cannot run. Pythonic arguments are read with
    ``ast.literal_eval``: literals only, nothing is evaluated.
    """
    check_tool_format(tool_format)
    names = {f["name"] for f in tool_functions(tools)}
    body = text.strip(_SPACE)
    if tool_format == "llama4_pythonic":
        body = _llama4_body(body)
    elif body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip(_SPACE)
    calls = _json_call(body) if tool_format == "llama3_json" else _pythonic_calls(body)
    if calls is None or any(call["name"] not in names for call in calls):
        return None
    return calls


def _llama4_body(body: str) -> str:
    """A Llama 4 reply without the end-of-turn marker and the code markers around it."""
    for end in ("<|eot|>", "<|eom|>"):
        body = body.removesuffix(end).strip(_SPACE)
    if body.startswith("<|python_start|>"):
        body = body[len("<|python_start|>"):].removesuffix("<|python_end|>").strip(_SPACE)
    return body


def _json_call(body: str) -> list[dict] | None:
    if not body.startswith("{"):
        return None
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        return None
    name, arguments = call.get("name"), call.get("parameters", call.get("arguments"))
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return [{"name": name, "arguments": arguments}]


def _pythonic_calls(body: str) -> list[dict] | None:
    if not body.startswith("["):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        names = [k.arg for k in node.keywords]
        if None in names or len(set(names)) != len(names):
            return None
        name = node.func.id
        if not body.isascii():  # ast reads names NFKC-normalized (µ as μ, ﬁ as fi): the tools' are as written
            name = ast.get_source_segment(body, node.func)
            names = [ast.get_source_segment(body, k).partition("=")[0].strip() for k in node.keywords]
        try:
            arguments = {key: _json_value(ast.literal_eval(k.value)) for key, k in zip(names, node.keywords)}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        calls.append({"name": name, "arguments": arguments})
    return calls


def _json_value(value: object) -> object:
    """A Python literal's value as JSON data (tuples become lists); ValueError for what JSON lacks."""
    if value is None or isinstance(value, (str, bool, int)) or (isinstance(value, float) and math.isfinite(value)):
        return value  # a literal past float's range reads as inf, which JSON cannot carry
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_value(v) for k, v in value.items()}
    raise ValueError(f"{type(value).__name__} is not JSON data")


def tool_call_grammar(tools: list[dict], choice: str | dict, tool_format: str, parallel: bool) -> str:
    """A Lark grammar for llguidance that admits exactly the replies ``parse_tool_calls`` reads as valid calls.

    ``choice``: "required" (a call to any of the tools), a named function
    ``{"type": "function", "function": {"name": ...}}`` (a call to that one), or "auto" (plain text
    that does not start like a call, i.e. with ``{``, ``[`` or ``<|python_tag|>`` after any
    whitespace, or else a call constrained from its first token on). The stop token is left to
    the tokenizer's EOS set: the grammar accepts where the call (or the text) is complete. A Llama 4
    call opens with no marker (its tokenizer has no ``<|python_tag|>``), as Meta's prompt format shows.
    """
    check_tool_format(tool_format)
    functions = tool_functions(tools)
    if not functions:
        raise ValueError("a tool-call grammar needs at least one tool")
    if choice == "none":
        raise ValueError("tool_choice 'none' needs no tool-call grammar: the reply is plain text")
    name = chosen_function(choice, functions)
    chosen = [f for f in functions if name in (None, f["name"])]
    rules = _Rules()
    if tool_format == "llama3_json":
        alternatives = [rules.new("%json " + json.dumps(_json_call_schema(f))) for f in chosen]
        call = " | ".join(alternatives)
    else:
        call = rules.new(" | ".join(_pythonic_call(rules, f) for f in chosen))
        call = f'"[" {call} (", " {call}){{0,{MAX_CALLS - 1}}} "]"' if parallel else f'"[" {call} "]"'
    start = call if tool_format == "llama4_pythonic" else f"<|python_tag|>? ({call})"
    head = f"start: TEXT | {start}\n{_TEXT_RULE}" if choice == "auto" else f"start: {start}"
    return head + "\n" + "\n".join(f"{k}: {v}" for k, v in rules.rules.items()) + "\n"


def _json_call_schema(function: dict) -> dict:
    """The JSON schema of one llama3_json call to ``function``, its parameters' local $refs re-rooted."""
    return {
        "x-guidance": _JSON_OPTIONS,
        "type": "object",
        "properties": {
            "type": {"const": "function"},
            "name": {"const": function["name"]},
            "parameters": _reroot(function["parameters"], "#/properties/parameters"),
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _reroot(schema: object, root: str) -> object:
    """``schema`` with every local ``$ref`` pointing at the same place once it sits under ``root``."""
    if isinstance(schema, list):
        return [_reroot(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value
        else:
            out[key] = _reroot(value, root)
    return out


class _Rules:
    """Lark rules under construction; each $ref gets one named rule, so shared and recursive ones resolve."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}

    def new(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules[name] = body
        return name


def _lark(text: str) -> str:
    """A Lark string literal matching ``text`` exactly."""
    return json.dumps(text, ensure_ascii=False)


def _pythonic_call(rules: _Rules, function: dict) -> str:
    """``name(key=value, ...)``: the properties in schema order, each optional one free to be left out."""
    name, params = function["name"], function["parameters"]
    path = f"tools[{function['name']}].parameters"
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"pythonic calls need Python names; tool {name!r} is not one")
    _check_keys(params, path, _ANNOTATIONS | {"type", "properties", "required", "additionalProperties"})
    if params.get("type", "object") != "object":
        raise ValueError(f"{path}: a pythonic call's parameters must be an object")
    items = []
    for key, schema in params.get("properties", {}).items():
        if not key.isidentifier() or keyword.iskeyword(key):
            raise ValueError(f"{path}: parameter {key!r} is not a Python keyword-argument name")
        value = _value(rules, schema, params, f"{path}.properties.{key}")
        items.append((f'"{key}=" {value}', key in params.get("required", [])))
    _check_required(params, path)
    return f'"{name}(" {_sequence(rules, items)} ")"' if items else _lark(f"{name}()")


def _sequence(rules: _Rules, items: list[tuple[str, bool]]) -> str:
    """``items`` (expression, required) in order, comma-separated, each optional one free to be left out.

    Two rules per position: the rest when nothing is written yet (no comma before the next item)
    and the rest once something is (a comma before it), so a list of n items stays n rules long.
    """
    fresh = later = ""
    for i in reversed(range(len(items))):
        expr, required = items[i]
        tail = f" {later}" if later else ""
        if required:
            first = f"{expr}{tail}"
        else:
            first = f"{expr}{tail} | {fresh}" if fresh else f"({expr})?"
        if i:
            later = rules.new(f'", " {expr}{tail}' if required else f'(", " {expr})?{tail}')
        fresh = rules.new(first)
    return fresh


def _value(rules: _Rules, schema: object, root: dict, path: str) -> str:
    """A rule name for the Python literals that validate against ``schema``."""
    if schema is True or (isinstance(schema, dict) and not set(schema) - _ANNOTATIONS):
        return _any(rules)
    if not isinstance(schema, dict):
        raise ValueError(f"{path}: {schema!r} is not a schema a pythonic argument can meet")
    _check_keys(schema, path, _KNOWN)
    _check_shapes(schema, path)
    for combinator in ("$ref", "anyOf", "oneOf"):
        if combinator in schema:
            if set(schema) - _ANNOTATIONS - {combinator}:
                raise ValueError(f"{path}: keywords beside {combinator!r} are not supported in pythonic calls")
            if combinator == "$ref":
                return _ref(rules, schema["$ref"], root, path)
            branches = schema[combinator]
            if combinator == "oneOf" and not _disjoint(branches):
                raise ValueError(f"{path}: 'oneOf' with branches of the same type is not supported in "
                                 "pythonic calls; use 'anyOf'")
            return rules.new(" | ".join(_value(rules, b, root, f"{path}.{combinator}[{i}]")
                                        for i, b in enumerate(branches)))
    types = schema.get("type") or [t for t, keys in _KEYWORDS.items() if keys & set(schema)] or list(_KEYWORDS)
    types = [types] if isinstance(types, str) else types
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        values = [v for v in values if any(_is_type(v, t) for t in types)]
        if not values:
            raise ValueError(f"{path}: no value of its enum/const has its type")
        return rules.new(" | ".join(_lark(py_literal(v)) for v in values))
    return rules.new(" | ".join(_typed(rules, schema, t, root, path) for t in types))


def _typed(rules: _Rules, schema: dict, kind: str, root: dict, path: str) -> str:
    if kind not in _KEYWORDS:
        raise ValueError(f"{path}: unknown type {kind!r}")
    if kind == "boolean":
        return '"True" | "False"'
    if kind == "null":
        return '"None"'
    if kind in ("string", "integer", "number"):
        leaf = {"type": kind, **{k: schema[k] for k in _KEYWORDS[kind] if k in schema}}
        if kind == "string":
            leaf["x-guidance"] = _PY_STRING_OPTIONS
        return rules.new("%json " + json.dumps(leaf))
    if kind == "array":
        item = _value(rules, schema.get("items", True), root, f"{path}.items")
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high == 0:
            return '"[]"'
        more = "" if high == 1 else f' (", " {item}){{{max(low - 1, 0)},{"" if high is None else high - 1}}}'
        listed = f'"[" {item}{more} "]"'
        return listed if low > 0 else f'"[]" | {listed}'
    _check_required(schema, path)
    props = schema.get("properties")
    if props:
        items = [(f"{_lark(py_literal(k) + ': ')} {_value(rules, s, root, f'{path}.properties.{k}')}",
                  k in schema.get("required", [])) for k, s in props.items()]
        return f'"{{" {_sequence(rules, items)} "}}"'
    extra = schema.get("additionalProperties", True)
    if extra is False:
        return '"{}"'
    key = rules.new("%json " + json.dumps({"type": "string", "x-guidance": _PY_STRING_OPTIONS}))
    entry = f'{key} ": " {_value(rules, extra, root, f"{path}.additionalProperties")}'
    return f'"{{}}" | "{{" {entry} (", " {entry})* "}}"'


def _any(rules: _Rules) -> str:
    """Any Python literal of JSON data: what an unconstrained (``{}``) schema admits."""
    if "any" not in rules.refs:
        name = rules.refs["any"] = rules.new("")
        string = rules.new("%json " + json.dumps({"type": "string", "x-guidance": _PY_STRING_OPTIONS}))
        number = rules.new('%json {"type": "number"}')
        entry = f'{string} ": " {name}'
        rules.rules[name] = (f'{string} | {number} | "True" | "False" | "None" | "[]" | "[" {name} '
                             f'(", " {name})* "]" | "{{}}" | "{{" {entry} (", " {entry})* "}}"')
    return rules.refs["any"]


def _ref(rules: _Rules, ref: object, root: dict, path: str) -> str:
    """The rule of a local ``$ref`` (a JSON pointer into the parameters schema), made once."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise ValueError(f"{path}: only local $refs ('#/...') are supported, got {ref!r}")
    if ref not in rules.refs:
        name = rules.refs[ref] = rules.new("")
        target: object = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"{path}: $ref {ref!r} points at nothing")
            target = target[part]
        rules.rules[name] = _value(rules, target, root, ref)
    return rules.refs[ref]


def _check_keys(schema: dict, path: str, allowed: set[str]) -> None:
    unknown = sorted(set(schema) - allowed)
    if unknown:
        raise ValueError(f"{path}: {unknown[0]!r} is not supported in pythonic tool calls")


def _check_shapes(schema: dict, path: str) -> None:
    """Keywords whose values have the wrong JSON type are refused, as the grammar would misread them or fail."""
    kinds = schema.get("type", [])
    if not isinstance(kinds, str) and not is_string_list(kinds):
        raise ValueError(f"{path}: 'type' must be a string or an array of strings")
    for key in ("enum", "anyOf", "oneOf"):
        if key in schema and not (isinstance(schema[key], list) and schema[key]):
            raise ValueError(f"{path}: {key!r} must be a non-empty array")
    if "properties" in schema and not isinstance(schema["properties"], dict):
        raise ValueError(f"{path}: 'properties' must be an object")
    low, high = schema.get("minItems", 0), schema.get("maxItems", 0)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in (low, high)):
        raise ValueError(f"{path}: 'minItems' and 'maxItems' must be non-negative integers")
    if "maxItems" in schema and low > high:
        raise ValueError(f"{path}: 'minItems' is above 'maxItems', so no array can meet it")


def _check_required(schema: dict, path: str) -> None:
    required = schema.get("required", [])
    if not is_string_list(required):
        raise ValueError(f"{path}: 'required' must be an array of strings")
    missing = [k for k in required if k not in schema.get("properties", {})]
    if missing:
        raise ValueError(f"{path}: required {missing[0]!r} is not among its properties")


def _disjoint(branches: object) -> bool:
    """True when every oneOf branch has one type of its own, so at most one branch can match."""
    if not isinstance(branches, list):
        return False
    kinds = [b.get("type") if isinstance(b, dict) else None for b in branches]
    kinds = ["number" if k == "integer" else k for k in kinds]
    return all(isinstance(k, str) for k in kinds) and len(set(kinds)) == len(kinds)


def _is_type(value: object, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _PY_TYPES.get(kind, ()))
