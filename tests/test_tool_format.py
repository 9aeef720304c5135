"""Meta's tool-calling formats: prompts token for token against Meta's own code and prompt guides, replies
parsed from Meta's own encoder, and llguidance grammars whose every random walk is a call that parses and
validates (or, under "auto", text that never starts like a call).

The oracle is the llama-models package (tests/support/meta_reference.py): its ChatFormat, ToolUtils and
types, and the prompt guides it ships (llama3_1/prompt_format.md, llama3_2/text_prompt_format.md), whose
tool prompts Meta's generators (JsonCustomToolGenerator, PythonListCustomToolGenerator, no longer in the
package) wrote.
"""

from __future__ import annotations

import importlib.resources
import json
import random
import re

import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher
from llguidance.tiktoken import lltokenizer_from_encoding

from tp_llama.tokenizer import SentencePieceTokenizer, load_tokenizer
from tp_llama.tool_calls import parse_tool_calls, tool_call_grammar
from tp_llama.tool_format import encode_tool_chat


@pytest.fixture(scope="module")
def tok(meta):
    return load_tokenizer(meta.model_path)


def tool(name: str, description: str, properties: dict, required: list[str], **extra) -> dict:
    params = {"type": "object", "properties": properties, "required": required, **extra}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TRENDING = tool("trending_songs", "Returns the trending songs on a Music site", {
    "n": {"type": "integer", "description": "The number of songs to return"},
    "genre": {"type": "string", "description": "The genre of the songs to return"},
}, ["n"])
WEATHER = tool("get_weather", "Get weather info for places", {
    "city": {"type": "string", "description": "The name of the city to get the weather for"},
    "metric": {"type": "string", "description": "The metric for weather. Options are: celsius, fahrenheit",
               "default": "celsius"},
}, ["city"])
TODAY = "21 September 2024"  # the date of the Llama 3.1 guide's example


# ---------------------------------------------------------------------------------------------
# Prompts


def guide_turns(package: str, doc: str, title: str) -> list[tuple[str, str]]:
    """(role, content) of the input prompt of the guide's example ``title``."""
    text = (importlib.resources.files(package) / doc).read_text()
    section = text[text.index(f"## {title}\n"):]
    prompt = section[section.index("```\n", section.index("##### Input Prompt Format")) + 4:]
    prompt = prompt[:prompt.index("```")]
    turns = re.findall(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)<\|eo[mt]_id\|>", prompt, re.S)
    assert turns, f"no turns in {doc}: {title}"
    return turns


def json_guide_turns() -> list[tuple[str, str]]:
    turns = guide_turns("llama_models.llama3_1", "prompt_format.md", "JSON based tool calling")
    assert [role for role, _ in turns] == ["system", "user", "user"]
    return turns


def pythonic_guide_system() -> str:
    """The Llama 3.2 guide's system prompt; its "required" list is broken over lines there (the guide's
    text was typed by hand), while PythonListCustomToolGenerator writes it on one line."""
    turns = guide_turns("llama_models.llama3_2", "text_prompt_format.md", "Zero shot function calling")
    assert [role for role, _ in turns] == ["system", "user"]
    return re.sub(r'"required": \[\s*("[^"]*")\s*\]', r'"required": [\1]', turns[0][1])


def meta_ids(meta, turns: list, tool_format: str) -> list[int]:
    """Meta's ChatFormat on (role, content) pairs and ready RawMessages."""
    from llama_models.datatypes import RawMessage, ToolPromptFormat

    messages = [t if isinstance(t, RawMessage) else RawMessage(role=t[0], content=t[1]) for t in turns]
    fmt = {"llama3_json": ToolPromptFormat.json, "pythonic": ToolPromptFormat.python_list}[tool_format]
    return list(meta.chat_format.encode_dialog_prompt(messages, fmt).tokens)


def history(meta, arguments: dict, eom: bool) -> tuple[list[dict], list]:
    """A call, its result and a follow-up, as OpenAI messages and as Meta's RawMessages."""
    from llama_models.datatypes import RawMessage, StopReason, ToolCall

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    openai = [{"role": "assistant", "content": None, "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "call_1", "content": '"25 C"'},
              {"role": "assistant", "content": "It is 25 C in Paris."},
              {"role": "user", "content": "And tomorrow?"}]
    raw = [RawMessage(role="assistant", content="", tool_calls=[ToolCall(call_id="call_1", tool_name="get_weather",
                                                                         arguments=arguments)],
                      stop_reason=StopReason.end_of_message if eom else StopReason.end_of_turn),
           RawMessage(role="tool", content='"25 C"'),
           RawMessage(role="assistant", content="It is 25 C in Paris.", stop_reason=StopReason.end_of_turn),
           RawMessage(role="user", content="And tomorrow?")]
    return openai, raw


def test_json_tools_only_match_the_llama31_guide(meta, tok):
    system, tools_text, question = json_guide_turns()
    ours = encode_tool_chat(tok, [{"role": "system", "content": "You are a helpful assistant."},
                                  {"role": "user", "content": question[1]}], [TRENDING], "llama3_json", today=TODAY)
    assert ours == meta_ids(meta, [system, tools_text, question], "llama3_json")
    assert tok.decode(ours).count("<|start_header_id|>user<|end_header_id|>") == 2  # the tools are a user turn


def test_pythonic_tools_only_match_the_llama32_guide(meta, tok):
    question = "What is the weather in SF and Seattle?"
    ours = encode_tool_chat(tok, [{"role": "user", "content": question}], [WEATHER], "pythonic")
    assert ours == meta_ids(meta, [("system", pythonic_guide_system()), ("user", question)], "pythonic")


@pytest.mark.parametrize("ipython", [True, False])
def test_json_history_matches_meta_chat_format(meta, tok, ipython):
    """A call (ending <|eom_id|> only under "Environment: ipython"), its result in the ipython role, a follow-up."""
    system, tools_text, question = json_guide_turns()
    if not ipython:
        system = ("system", system[1].removeprefix("Environment: ipython\n\n"))
    arguments = {"city": "Paris", "metric": "celsius"}
    openai, raw = history(meta, arguments, eom=ipython)
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question[1]}]
    ours = encode_tool_chat(tok, messages + openai, [TRENDING], "llama3_json", ipython=ipython, today=TODAY)
    assert ours == meta_ids(meta, [system, tools_text, question, *raw], "llama3_json")
    assert (tok.special_ids["<|eom_id|>"] in ours) == ipython
    assert "<|start_header_id|>ipython<|end_header_id|>" in tok.decode(ours)


def test_text_parts_encode_apart_like_meta_chat_format(meta, tok):
    """OpenAI text parts in a tools chat are Meta's RawTextItems, each encoded on its own ("Hel" + "lo")."""
    from llama_models.datatypes import RawMessage, RawTextItem

    from tp_llama.serving.openai_api import chat_messages

    system, tools_text, question = json_guide_turns()
    openai, raw = history(meta, {"city": "Paris"}, eom=True)  # a call, its result, a reply, a follow-up
    openai.insert(0, {"role": "user"})
    raw.insert(0, RawMessage(role="user", content=""))
    for at, texts in {0: ["Hel", "lo ", question[1]], 2: ['"25', ' C"'], 3: ["It is", " 25 C", ""]}.items():
        openai[at] = {**openai[at], "content": [{"type": "text", "text": t} for t in texts]}
        raw[at].content = [RawTextItem(text=t) for t in texts]
    messages = [{"role": "system", "content": "You are a helpful assistant."}, *openai]
    ours = encode_tool_chat(tok, chat_messages(messages), [TRENDING], "llama3_json", today=TODAY)
    assert ours == meta_ids(meta, [system, tools_text, *raw], "llama3_json")


def test_pythonic_history_matches_meta_chat_format(meta, tok):
    question = "What is the weather in SF?"
    openai, raw = history(meta, {"city": "San Francisco", "metric": "celsius", "days": [1, 2], "hourly": True}, False)
    ours = encode_tool_chat(tok, [{"role": "user", "content": question}] + openai, [WEATHER], "pythonic")
    assert ours == meta_ids(meta, [("system", pythonic_guide_system()), ("user", question), *raw], "pythonic")
    assert '[get_weather(city="San Francisco", metric="celsius", days=[1, 2], hourly=True)]' in tok.decode(ours)


def test_system_message_and_tool_choice_placement(tok):
    """A pythonic system message follows the tool list; a forced choice adds one line to the system prompt."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    text = tok.decode(encode_tool_chat(tok, chat, [WEATHER, TRENDING], "pythonic", tool_choice=choice))
    system = text.split("<|eot_id|>")[0]
    assert system.endswith("]\nBe brief.\nYou MUST use the tool `get_weather` to answer the user query.")
    assert system.index('"get_weather"') < system.index('"trending_songs"')
    text = tok.decode(encode_tool_chat(tok, chat, [TRENDING], "llama3_json", tool_choice="required", today=TODAY))
    assert text.split("<|eot_id|>")[0].endswith(
        f"{TODAY}\n\nBe brief.\nYou MUST use one of the provided functions/tools to answer the user query.\n")


def test_parallel_pythonic_calls_are_one_list(tok):
    calls = [{"id": str(i), "type": "function", "function": {"name": n, "arguments": a}}
             for i, (n, a) in enumerate([("get_weather", '{"city": "Oslo"}'), ("trending_songs", '{"n": 3}')])]
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    text = tok.decode(encode_tool_chat(tok, chat, [WEATHER, TRENDING], "pythonic"))
    assert '<|end_header_id|>\n\n[get_weather(city="Oslo"), trending_songs(n=3)]<|eot_id|>' in text
    with pytest.raises(ValueError, match="one tool call per assistant message"):
        encode_tool_chat(tok, chat, [WEATHER, TRENDING], "llama3_json")


class _FakeSentencePiece:
    def vocab_size(self) -> int:
        return 32000

    def bos_id(self) -> int:
        return 1

    def eos_id(self) -> int:
        return 2


@pytest.mark.parametrize("bad, match", [
    ({"messages": [{"role": "tool"}]}, "content must be a str"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, "system message only"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]}, "is not JSON"),
    ({"tools": [{"type": "function", "function": {"name": "a"}}] * 2}, "two tools are named 'a'"),
    ({"tools": [{"name": "a"}]}, r"tools\[0\] must be"),
    ({"tool_format": "hermes"}, "tool_format must be one of"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of the tools"),
])
def test_bad_requests_raise(tok, bad, match):
    args = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_format": "pythonic",
            "tool_choice": "auto", **bad}
    with pytest.raises(ValueError, match=match):
        encode_tool_chat(tok, args["messages"], args["tools"], args["tool_format"], tool_choice=args["tool_choice"])


def test_a_llama2_tokenizer_is_refused():
    with pytest.raises(ValueError, match="tools need a Llama 3 checkpoint"):
        encode_tool_chat(SentencePieceTokenizer(_FakeSentencePiece()), [{"role": "user", "content": "hi"}],
                         [WEATHER], "llama3_json")


# ---------------------------------------------------------------------------------------------
# Parsing


@pytest.mark.parametrize("tool_format", ["llama3_json", "pythonic"])
def test_meta_encoded_calls_parse(tool_format):
    from llama_models.datatypes import ToolCall, ToolPromptFormat
    from llama_models.llama3.tool_utils import ToolUtils

    fmt = {"llama3_json": ToolPromptFormat.json, "pythonic": ToolPromptFormat.python_list}[tool_format]
    for arguments in [{"city": "Paris"}, {"city": "São Paulo", "metric": "celsius", "n": -3, "x": 2.5,
                                          "ok": False, "none": None, "days": [1, 2.5, "b"]}, {}]:
        text = ToolUtils.encode_tool_call(ToolCall(call_id="1", tool_name="get_weather", arguments=arguments), fmt)
        for wrapped in (text, f"<|python_tag|>{text}", f"\n  <|python_tag|> {text}\n"):
            assert parse_tool_calls(wrapped, tool_format, [WEATHER]) == [{"name": "get_weather", "arguments": arguments}]


def test_json_calls_without_type_and_pythonic_lists():
    assert parse_tool_calls('{"name": "trending_songs", "parameters": {"n": 10}}', "llama3_json", [TRENDING]) == [
        {"name": "trending_songs", "arguments": {"n": 10}}]
    text = "[get_weather(city='SF', metric=\"c\"), trending_songs(n=(1, 2), genre={'a': [True, None]})]"
    assert parse_tool_calls(text, "pythonic", [WEATHER, TRENDING]) == [
        {"name": "get_weather", "arguments": {"city": "SF", "metric": "c"}},
        {"name": "trending_songs", "arguments": {"n": [1, 2], "genre": {"a": [True, None]}}}]


@pytest.mark.parametrize("tool_format, text", [
    ("llama3_json", "The weather is fine."),
    ("llama3_json", ""),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"'),
    ("llama3_json", '{"name": "get_weather", "parameters": "city"}'),
    ("llama3_json", '{"type": "code", "name": "get_weather", "parameters": {}}'),
    ("llama3_json", '{"name": "rm_rf", "parameters": {}}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {}} {"name": "get_weather", "parameters": {}}'),
    ("llama3_json", 'Sure: {"name": "get_weather", "parameters": {}}'),
    ("llama3_json", '["get_weather"]'),
    ("pythonic", "The weather is fine."),
    ("pythonic", "[get_weather(city='Paris')"),
    ("pythonic", "[]"),
    ("pythonic", "[get_weather('Paris')]"),
    ("pythonic", "[get_weather(city=open('/etc/passwd').read())]"),
    ("pythonic", "[get_weather(city=x)]"),
    ("pythonic", "[get_weather(city='a', city='b')]"),
    ("pythonic", "[get_weather(**{'city': 'a'})]"),
    ("pythonic", "[os.system(cmd='ls')]"),
    ("pythonic", "[rm_rf(path='/')]"),
    ("pythonic", "([get_weather(city='a')])"),
    ("pythonic", "[get_weather(city={1, 2})]"),
    ("pythonic", "[get_weather(city=b'x')]"),
    ("pythonic", "[get_weather(city='a')] and more"),
    ("pythonic", "[" * 10000),
    ("pythonic", "[get_weather(city=1e999)]"),  # inf: no JSON number carries it
    ("pythonic", "[get_weather(city=[-1e999])]"),
])
def test_text_and_malformed_replies_are_not_calls(tool_format, text):
    assert parse_tool_calls(text, tool_format, [WEATHER]) is None


# ---------------------------------------------------------------------------------------------
# Grammars: random walks over the allowed tokens


@pytest.fixture(scope="module")
def ll(tok):
    """llguidance's tokenizer over the same tiktoken encoding, EOS being <|eot_id|>."""
    return lltokenizer_from_encoding(tok._enc, eos_token=tok.special_ids["<|eot_id|>"])


@pytest.fixture(scope="module")
def walker(tok, ll):
    eot = tok.special_ids["<|eot_id|>"]

    def walk(grammar: str, rng: random.Random, prefix: list[int] = (), max_steps: int = 400) -> str:
        """Random allowed tokens after ``prefix`` until the matcher accepts and EOS is drawn (one chance in five)."""
        assert LLMatcher.validate_grammar(grammar) == ""
        matcher = LLMatcher(ll, grammar)
        assert not matcher.is_error(), matcher.get_error()
        ids = list(prefix)
        assert matcher.consume_tokens(ids), matcher.get_error()
        for _ in range(max_steps):
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                                                   bitorder="little"))
            assert (eot in allowed) == matcher.is_accepting()
            if matcher.is_accepting() and (len(allowed) == 1 or rng.random() < 0.2):
                assert matcher.consume_token(eot)
                return tok.decode(ids)
            ids.append(int(rng.choice(allowed[allowed != eot])))
            assert matcher.consume_token(ids[-1]), matcher.get_error()
        raise AssertionError(f"no end after {max_steps} tokens: {tok.decode(ids)!r}")

    return walk


WALK_TOOLS = [
    tool("get_weather", "", {"city": {"type": "string", "maxLength": 8},
                             "unit": {"enum": ["celsius", "fahrenheit"]},
                             "days": {"type": "integer", "minimum": 1, "maximum": 3}},
         ["city"], additionalProperties=False),
    tool("set_flags", "", {
        "on": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 2},
        "level": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 10}]},
        "where": {"$ref": "#/$defs/point"},
        "mode": {"const": "fast"},
    }, ["on", "where"], additionalProperties=False, **{"$defs": {"point": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                         "label": {"type": ["string", "null"], "maxLength": 4}},
        "required": ["x"], "additionalProperties": False}}}),
    tool("ping", "", {}, [], additionalProperties=False),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in WALK_TOOLS}
NAMED = {"type": "function", "function": {"name": "set_flags"}}


def check_calls(text: str, tool_format: str, choice) -> list[dict]:
    calls = parse_tool_calls(text, tool_format, WALK_TOOLS)
    assert calls, f"not a call: {text!r}"
    for call in calls:
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
        assert choice != NAMED or call["name"] == "set_flags"
    return calls


@pytest.mark.parametrize("tool_format, choice, parallel", [
    ("llama3_json", "required", True),
    ("llama3_json", NAMED, False),
    ("pythonic", "required", False),
    ("pythonic", "required", True),
    ("pythonic", NAMED, True),
])
def test_forced_calls_always_parse_and_validate(walker, tool_format, choice, parallel):
    grammar = tool_call_grammar(WALK_TOOLS, choice, tool_format, parallel)
    rng = random.Random(7)
    counts = [len(check_calls(walker(grammar, rng), tool_format, choice)) for _ in range(12)]
    if tool_format == "pythonic" and parallel:
        assert max(counts) > 1, "parallel pythonic walks never made two calls"
    else:
        assert set(counts) == {1}


@pytest.mark.parametrize("tool_format", ["llama3_json", "pythonic"])
def test_auto_is_text_or_a_constrained_call(walker, tok, ll, tool_format):
    grammar = tool_call_grammar(WALK_TOOLS, "auto", tool_format, True)
    rng = random.Random(11)
    for _ in range(12):  # left to itself, a random walk writes text: never one that reads as a call
        text = walker(grammar, rng)
        assert parse_tool_calls(text, tool_format, WALK_TOOLS) is None, text
        assert not re.match(r"[ \t\n\r]*(\{|\[|<\|python_tag\|>)", text), text
    opener = tok.encode("{" if tool_format == "llama3_json" else "[", bos=False)
    for prefix in (opener, [tok.special_ids["<|python_tag|>"]]):
        matcher = LLMatcher(ll, grammar)
        assert matcher.consume_tokens(prefix) and not matcher.is_accepting()
        for _ in range(4):  # a started call ends as a valid one
            check_calls(walker(grammar, rng, prefix), tool_format, "auto")


def test_pythonic_grammar_refuses_what_it_cannot_enforce():
    for params, match in [
        ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "'uniqueItems'"),
        ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}}}, "'allOf'"),
        ({"type": "object", "properties": {"class": {"type": "string"}}}, "'class' is not a Python"),
        ({"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}, "oneOf"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "points at nothing"),
        ({"type": "object", "properties": {"a": {"type": 1}}}, "'type' must be"),
        ({"type": "object", "properties": {"a": {"type": [["string"]]}}}, "'type' must be"),
        ({"type": "object", "properties": {"a": {"enum": "ab"}}}, "'enum' must be"),
        ({"type": "object", "properties": {"a": {"anyOf": {"type": "string"}}}}, "'anyOf' must be"),
        ({"type": "object", "properties": {"a": {"anyOf": []}}}, "'anyOf' must be"),
        ({"type": "object", "properties": {"a": {"type": "array", "minItems": "2"}}}, "'minItems'"),
        ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 1}}}, "'minItems'"),
        ({"type": "object", "properties": {"a": {"type": "object", "properties": [1]}}}, "'properties' must be"),
        ({"type": "object", "properties": {"a": {"type": "object", "required": 1}}}, "'required' must be"),
        ({"type": "object", "properties": {"a": {}}, "required": 1}, "required must be"),
    ]:
        bad = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        with pytest.raises(ValueError, match=match):
            tool_call_grammar(bad, "required", "pythonic", False)
    with pytest.raises(ValueError, match="not one"):
        tool_call_grammar([tool("my-tool", "", {}, [])], "required", "pythonic", False)
    with pytest.raises(ValueError, match="required must be an array of strings"):
        tool_call_grammar([tool("f", "", {"a": {}}, [["a"]])], "required", "llama3_json", False)
    with pytest.raises(ValueError, match="needs no tool-call grammar"):
        tool_call_grammar(WALK_TOOLS, "none", "llama3_json", False)


def test_json_schemas_llguidance_cannot_enforce_fail_to_compile():
    """llama3_json leaves the schema to llguidance, which refuses what it lacks rather than loosening it."""
    bad = [tool("f", "", {"a": {"type": "string", "format": "no-such-format"}}, ["a"])]
    assert "no-such-format" in LLMatcher.validate_grammar(tool_call_grammar(bad, "required", "llama3_json", False))
