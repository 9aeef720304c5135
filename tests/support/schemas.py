"""The schema corpus of the structured-output tests, shared with the benchmarks that time it
(bench/kernels/masks.py, bench/serving/structured.py): both must exercise the same schemas.
"""

from __future__ import annotations

# Bounded schemas: every object closed (additionalProperties false), every string, array and number
# bounded, so a reply of random tokens must end.
_NAME = {"type": "string", "minLength": 1, "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "additionalProperties": False, "required": ["keeper"],
     "properties": {"keeper": {"type": "object", "additionalProperties": False, "required": ["name", "shift"],
                               "properties": {"name": _NAME, "shift": {"enum": ["dawn", "dusk", "night"]},
                                              "years": {"type": "integer", "minimum": 1, "maximum": 60}}}}},
    {"type": "object", "additionalProperties": False, "required": ["readings"],
     "properties": {"readings": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": {"type": "integer", "minimum": -50, "maximum": 50}}}},
    {"type": "array", "minItems": 2, "maxItems": 4, "items": {"enum": ["red", "green", 7, None, True]}},
    {"$defs": {"lamp": {"type": "object", "additionalProperties": False, "required": ["watts"],
                        "properties": {"watts": {"type": "integer", "minimum": 10, "maximum": 999}}}},
     "type": "object", "additionalProperties": False, "required": ["main"],
     "properties": {"main": {"$ref": "#/$defs/lamp"}, "spare": {"$ref": "#/$defs/lamp"}}},
    {"type": "object", "additionalProperties": False, "required": ["signal"],
     "properties": {"signal": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                         {"type": "string", "maxLength": 3},
                                         {"type": "boolean"}]}}},
    {"type": "object", "additionalProperties": False, "required": ["code", "day", "id"],
     "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "day": {"type": "string", "format": "date"},
                    "id": {"type": "string", "format": "uuid"}}},
    {"type": "object", "additionalProperties": False, "required": ["ratio"],
     "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1}, "ok": {"type": "boolean"}}},
]
# A short label per schema, in SCHEMAS' order, for the benchmarks' tables.
NAMES = ["name+age", "nested+enum", "int array", "enum array", "$ref/$defs", "anyOf", "pattern+format", "number"]
