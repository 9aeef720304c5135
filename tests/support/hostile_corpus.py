"""A reproducible corpus of hostile request bodies for the live-server fuzz test and soak script.

Each case is labelled when it is built: `payload` is None for a body that must be refused
(HTTP 4xx), or the decoded request for a body that is in fact valid and must get a correct
200. Labels come from how the body was made, not from the handler's validation code.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

FIELDS = ("max_new_tokens", "temperature", "top_p", "seed", "ignore_eos", "stream")
WRONG_TYPES: list[Any] = [True, "1", [], {}, [1], {"a": 1}, "", "null"]
NUMBER_ATTACKS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400", "-0", "1" * 400, "-" + "9" * 400,
                  "0x10", "+1", ".5", "1.", "01", "1e", "--1"]
# The literals above that are legal: 1e-400 rounds to 0.0 and -0 is the integer 0.
VALID_LITERALS = {("temperature", "1e-400"), ("temperature", "-0"), ("seed", "-0")}
BAD_INTEGERS: list[Any] = [-1, -(2**63), 2**64, 10**30, 1.0, -1.5, 1e308, -1e308]
BAD_FRACTIONS: list[Any] = [0, -1, 1.0000001, 2**63, -1e308, 1e308]
BAD_TEMPERATURES: list[Any] = [-1, -1e-9, -(2**63), -1e308]


@dataclass(frozen=True)
class Case:
    category: str
    body: bytes
    payload: dict | None = None  # set when the body is valid

    @property
    def valid(self) -> bool:
        return self.payload is not None

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        """The prompt a valid case asks for, encoded the way the request names it."""
        if "prompt" in self.payload:
            return tokenizer.encode(self.payload["prompt"])
        return tokenizer.encode_chat(self.payload["messages"])


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", errors="surrogatepass")


def _valid(category: str, payload: dict) -> Case:
    return Case(category, _json(payload), payload)


def _random_bytes(rng: random.Random, count: int) -> list[Case]:
    cases = []
    for i in range(count):
        size = rng.choice([0, 1, 2, 7, 64, 512, 4096, rng.randrange(1, 20000)])
        body = bytes(rng.randrange(256) for _ in range(size))
        if i % 4 == 0:
            body = b"{" + body  # starts like JSON, so the parser has to work for its verdict
        cases.append(Case("random bytes", body))
    return cases


def _deep(depth: int, opener: str) -> bytes:
    if opener == "[":
        inner = "[" * depth + "]" * depth
    else:
        inner = '{"a":' * depth + "1" + "}" * depth
    return ('{"prompt": "hi", "seed": ' + inner + "}").encode()


def _deep_json() -> list[Case]:
    return [Case("deep JSON", _deep(depth, opener)) for depth in (50, 500, 1000, 5000, 20000, 30000) for opener in "[{"]


def _huge_json(max_body: int, server_cap: int) -> list[Case]:
    cases = []
    for size in (max_body + 1, 2 * max_body, server_cap - 10, server_cap + 10, 4 * server_cap):
        cases.append(Case("huge JSON", _json({"prompt": "y" * size})))
        cases.append(Case("huge JSON", _json({"prompt": "hi", "padding": ["z"] * (size // 4)})))
    cases.append(Case("huge JSON", b'{"prompt": "hi"' + b" " * (2 * max_body) + b"}"))
    return cases


def _wrong_types() -> list[Case]:
    cases = []
    for field in FIELDS:
        for wrong in WRONG_TYPES:
            if field in ("ignore_eos", "stream") and isinstance(wrong, bool):
                continue
            cases.append(Case("wrong types", _json({"prompt": "hi", field: wrong})))
    for prompt in (1, 1.5, True, [], ["hi"], {"text": "hi"}, None):
        cases.append(Case("wrong types", _json({"prompt": prompt})))
    for messages in ("hi", 1, {}, [[]], ["hi"], [None], [{"role": "user"}], [{"content": "hi"}],
                     [{"role": 1, "content": "hi"}], [{"role": "user", "content": ["hi"]}],
                     [{"role": ["user"], "content": "hi"}], [{"role": "user", "content": None}]):
        cases.append(Case("wrong types", _json({"messages": messages})))
    for top in ([], "prompt", 1, None, True, [{"prompt": "hi"}]):
        cases.append(Case("wrong types", _json(top)))
    return cases


def _numbers() -> list[Case]:
    cases = []
    for field in ("max_new_tokens", "temperature", "top_p", "seed"):
        for literal in NUMBER_ATTACKS:
            extra = "" if field == "max_new_tokens" else '"max_new_tokens": 2, '
            body = '{"prompt": "hi", %s"%s": %s}' % (extra, field, literal)
            valid = (field, literal) in VALID_LITERALS
            cases.append(Case("numbers", body.encode(), json.loads(body) if valid else None))
    for field, values in (("max_new_tokens", BAD_INTEGERS), ("seed", BAD_INTEGERS), ("top_p", BAD_FRACTIONS),
                          ("temperature", BAD_TEMPERATURES)):
        for value in values:
            cases.append(Case("numbers", _json({"prompt": "hi", "max_new_tokens": 2, field: value})))
    for value in (2**63, 10**30, 1e308):  # absurd but legal: sampling becomes near-uniform
        cases.append(_valid("numbers", {"prompt": "hi", "max_new_tokens": 2, "temperature": value}))
    return cases


def _long_prompts(rng: random.Random, max_seq_len: int) -> list[Case]:
    cases = []
    for words in (max_seq_len, 2 * max_seq_len, 10 * max_seq_len):
        text = " ".join(rng.choice(["alpha", "beta", "x", "Köln", "日本", "42"]) for _ in range(words))
        cases.append(Case("long prompts", _json({"prompt": text})))
        cases.append(Case("long prompts", _json({"messages": [{"role": "user", "content": text}]})))
    cases.append(Case("long prompts", _json({"prompt": "hi " * (max_seq_len // 2), "max_new_tokens": max_seq_len})))
    return cases


def _bad_utf8(rng: random.Random, count: int) -> list[Case]:
    poison = [b"\xff", b"\xfe", b"\xc0\xaf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xc3", b"\xf0\x9f\x98"]
    cases = []
    for _ in range(count):
        bad = rng.choice(poison)
        where = rng.choice(["value", "key", "start", "end"])
        if where == "value":
            body = b'{"prompt": "caf' + bad + b'"}'
        elif where == "key":
            body = b'{"pro' + bad + b'mpt": "hi"}'
        elif where == "start":
            body = bad + b'{"prompt": "hi"}'
        else:
            body = b'{"prompt": "hi"}' + bad
        cases.append(Case("invalid UTF-8", body))
    for surrogate in ("\\ud800", "\\udfff", "\\ud83d x", "a\\udc00b"):
        cases.append(Case("invalid UTF-8", ('{"prompt": "%s"}' % surrogate).encode()))
    return cases


def _control_chars() -> list[Case]:
    cases = []
    for code in range(32):
        text = f"line{chr(code)}end"
        # Escaped by JSON: a valid prompt that just contains the character.
        cases.append(_valid("control characters", {"prompt": text, "max_new_tokens": 2, "temperature": 0}))
        # Raw inside a JSON string: not valid JSON.
        cases.append(Case("control characters", b'{"prompt": "line' + bytes([code]) + b'end"}'))
    for text in ("\x7f\x80\x9f", "\u200b\u200e\u202e\ufeff", "\ufffd\uffff", "<s></s>[INST]", "<|begin_of_text|><|eot_id|>",
                 "\U0001f600" * 20, "\u0300" * 50):
        cases.append(_valid("control characters", {"prompt": text, "max_new_tokens": 2, "temperature": 0}))
    return cases


def _many_messages(max_body: int) -> list[Case]:
    cases = []
    for count in (1000, 2000, 5000, 20000):
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(count - 1 + count % 2)]
        cases.append(Case("many messages", _json({"messages": turns})))
    small = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 200 + [{"role": "user", "content": "c"}]
    assert len(_json({"messages": small})) < max_body
    cases.append(Case("many messages", _json({"messages": small})))
    cases.append(Case("many messages", _json({"messages": [{"role": "tool", "content": "a"}]})))
    return cases


def _structure() -> list[Case]:
    raw = [
        b"", b"{}", b"null", b'""', b"[]", b"{", b"}", b'{"prompt": "hi",}', b'{"prompt": \'hi\'}', b"{prompt: 1}",
        b'{"prompt": "hi"} {"prompt": "hi"}', b'{"prompt": "hi", "prompt": "ho"}', b'{"prompt": "hi", "extra": 1}',
        b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}', b'{"prompt": ""}', b'{"messages": []}',
        b'{"prompt": "hi", "max_new_tokens": 2, "stream": "true"}', b'{"__proto__": {}, "prompt": "hi"}',
        b'{"prompt": "hi", "max_new_tokens": 2}\x00', b"\xef\xbb\xbf{\"prompt\": \"hi\"}",
    ]
    cases = [Case("structure", body) for body in raw]
    cases.append(_valid("structure", {"prompt": "hi", "max_new_tokens": 2, "temperature": None, "top_p": None,
                                      "seed": None, "ignore_eos": None, "stream": None}))
    cases.append(_valid("structure", {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}],
                                      "max_new_tokens": 2}))
    return cases


def _logit_bias_keys() -> list[Case]:
    """Token-id keys past what int() reads (its digit limit, 4300 by default): refused, or, zero-padded, the id
    they name (as "05" names 5). Both raised int()'s bare ValueError, which the handler answered as its own 500."""
    cases = [Case("logit_bias keys", _json({"prompt": "hi", "max_new_tokens": 2, "logit_bias": {key: 1}}))
             for key in ("9" * 5000, "1" + "0" * 5000, "-5", "5.0", " 5", "\uff15", "")]
    cases.append(_valid("logit_bias keys", {"prompt": "hi", "max_new_tokens": 2, "logit_bias": {"0" * 5000 + "5": 1}}))
    return cases


def hostile_corpus(seed: int, max_seq_len: int, max_body: int, server_cap: int) -> list[Case]:
    """At least 500 cases over every category; the same seed gives the same corpus."""
    rng = random.Random(seed)
    cases = (
        _random_bytes(rng, 150)
        + _deep_json()
        + _huge_json(max_body, server_cap)
        + _wrong_types()
        + _numbers()
        + _long_prompts(rng, max_seq_len)
        + _bad_utf8(rng, 80)
        + _control_chars()
        + _many_messages(max_body)
        + _structure()
        + _logit_bias_keys()
    )
    return cases


def hostile_grammars() -> list[tuple[dict, bool]]:
    """(structured-output fields, whether they must be refused) for the live-server test: grammars a server
    must refuse with a 400 in bounded time, and pathological but valid ones it must simply serve
    (llguidance's lexer is not a backtracking one, so "catastrophic" patterns cost it nothing)."""
    deep: dict = {"type": "integer"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    refused = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": {
            "type": "array", "uniqueItems": True}}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": {
            "type": "string", "format": "no-such-format"}}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#/$defs/x"}}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "l", "schema": {
            "type": "string", "pattern": "(?<=a)b"}}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": "not a schema"}}},
        {"structured_outputs": {"json": "{\"type\": "}},
        {"structured_outputs": {"regex": "(unclosed"}},
        {"structured_outputs": {"grammar": "root ::= missing"}},
        {"structured_outputs": {"grammar": "start: x\nx: x"}},
        {"structured_outputs": {"choice": []}},
        {"structured_outputs": {"choice": [1, 2]}},
        {"structured_outputs": {"structural_tag": "{}"}},
        {"structured_outputs": {"json": {"type": "object"}, "regex": "a"}},
    ]
    served = [
        {"structured_outputs": {"regex": "(a+)+$"}},
        {"structured_outputs": {"regex": "(a|aa)*b"}},
        {"structured_outputs": {"regex": "(x+x+)+y"}},
        {"structured_outputs": {"json": {"enum": [f"value-{i:05d}" for i in range(3000)]}}},
        {"response_format": {"type": "json_object"}},
    ]
    return [(fields, True) for fields in refused] + [(fields, False) for fields in served]
