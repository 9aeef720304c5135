"""Schemas no value meets are refused before a grammar is built: the matcher would dead-end mid-reply.

Each schema a value meets comes with one such value, checked by the `jsonschema` package, so the
expectation does not rest on the code under test; each refused one has no value by construction (its
only way out is itself).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tp_llama.json_schema import check_has_instance, has_instance
from tp_llama.serving.request import RequestError
from tp_llama.serving.structured import grammar_spec
from tp_llama.tool_format import tool_functions

NODE = {"type": "object", "required": ["next"],
        "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}}}
MET = [  # (schema, a value that meets it)
    ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}, {"kids": [{}]}),
    ({"$defs": {"node": NODE}, "$ref": "#/$defs/node"}, {"next": {"next": None}}),
    ({"type": "array", "minItems": 0, "items": {"$ref": "#"}}, []),
    ({"$defs": {"a": {"type": "object", "required": ["b"], "properties": {"b": {"$ref": "#/$defs/b"}}},
                "b": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}, {"b": "x"}),
    ({"type": ["object", "array"], "minItems": 1, "items": {"$ref": "#"}, "required": ["x"],
      "properties": {"x": {"type": "integer"}}}, {"x": 1}),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 1}, [3]),
]
UNMET = [
    {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"},
    {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}},
    {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]}},
     "type": "object", "required": ["k"], "properties": {"k": {"$ref": "#/$defs/a"}}},
    {"allOf": [{"type": "string"}, False]},
    {"type": "array", "prefixItems": [{"$ref": "#"}]},
]


@pytest.mark.parametrize("schema, value", MET)
def test_a_schema_with_a_value_is_kept(schema, value):
    jsonschema.validate(value, schema)  # the witness: this schema has a value
    assert has_instance(schema)


@pytest.mark.parametrize("schema", UNMET)
def test_a_schema_no_value_meets_is_refused_with_its_place(schema):
    assert not has_instance(schema)
    with pytest.raises(ValueError, match="params: no value meets this schema"):
        check_has_instance(schema, "params")


def test_tools_and_response_formats_refuse_it_naming_the_field():
    loop = UNMET[1]
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters: no value meets"):
        tool_functions([{"type": "function", "function": {"name": "f", "parameters": MET[0][0]}},
                        {"type": "function", "function": {"name": "g", "parameters": loop}}])
    for body, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": loop}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": json.dumps(loop)}}, "structured_outputs.json"),
    ]:
        with pytest.raises(RequestError, match="no value meets") as info:
            grammar_spec(body)
        assert info.value.param == param
