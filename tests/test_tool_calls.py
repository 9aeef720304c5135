"""Tool calling on /v1/chat/completions, on random weights: every call the server reports parses, names a
given tool (the named one when one is forced) and its arguments validate against that tool's
parameters (the `jsonschema` library); streamed deltas add up to the whole reply; a forced choice is
always a call; a reply's calls go back into the history and are served again.
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from tests.test_handler_unit import final_json, new_handler, run_to_end, serve
from tp_llama.config import EngineConfig
from tp_llama.engine.constraint import grammar_tokenizer
from tp_llama.engine.core import Engine
from tp_llama.serving.grammars import GrammarCompiler
from tp_llama.serving.native import parse_request
from tp_llama.serving.openai_api import parse_openai
from tp_llama.serving.openai_reply import CHAT
from tp_llama.serving.request import RequestError
from tp_llama.serving.settings import HandlerSettings
from tp_llama.serving.tool_use import ToolReply, ToolUse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "system", "content": "You can look things up."}, {"role": "user", "content": "Weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
PATH = {"r": "v1/chat/completions"}
MAX_SEQ_LEN = 2048  # the tools' definitions make a long prompt with the small test tokenizer
SETTINGS = HandlerSettings(EngineConfig("/ckpt", max_seq_len=MAX_SEQ_LEN), default_max_new_tokens=64,
                           max_new_tokens_limit=200, temperature=1.0, top_p=1.0)


@pytest.fixture(scope="module")
def engine(synthetic_checkpoint) -> Engine:
    return Engine.load(EngineConfig(str(synthetic_checkpoint("llama3", mp=1)), "tp", "float32",
                                    max_seq_len=MAX_SEQ_LEN, max_batch_size=4, prefill_budget=512))


@pytest.fixture(scope="module")
def compiler(engine: Engine) -> GrammarCompiler:
    return GrammarCompiler(grammar_tokenizer(engine.tokenizer))


def make_handler(engine, compiler, tool_format: str):
    return new_handler(engine, dataclasses.replace(SETTINGS, tool_format=tool_format), compiler)


def ask(handler, seed: int, stream: bool = False, **fields) -> list:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 1.0, "seed": seed,
            "stream": stream, **fields}
    return run_to_end(handler, {"r": json.dumps(body).encode()}, paths=PATH)["r"]


def check_calls(calls: list[dict], choice) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert name in SCHEMAS and (choice != NAMED or name == "get_time")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def streamed_message(replies: list) -> tuple[str | None, list[dict], str]:
    """The content, the calls and the finish reason that a client puts together from the deltas."""
    content, calls, reason = None, {}, None
    for piece, _, _ in replies:
        for line in piece.splitlines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                if delta.get("content"):
                    content = (content or "") + delta["content"]
                for d in delta.get("tool_calls", []):
                    call = calls.setdefault(d["index"], {"id": None, "type": "function",
                                                         "function": {"name": None, "arguments": ""}})
                    call["id"] = d.get("id") or call["id"]
                    call["function"]["name"] = d.get("function", {}).get("name") or call["function"]["name"]
                    call["function"]["arguments"] += d.get("function", {}).get("arguments", "")
                reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("tool_format", ["llama3_json", "pythonic"])
@pytest.mark.parametrize("choice", ["required", NAMED, "auto"], ids=["required", "named", "auto"])
def test_calls_parse_name_a_tool_and_validate_streamed_or_not(engine, compiler, tool_format, choice):
    handler = make_handler(engine, compiler, tool_format)
    calls_seen = 0
    for seed in range(3):
        whole = final_json(ask(handler, seed, tool_choice=choice))["choices"][0]
        message, reason = whole["message"], whole["finish_reason"]
        if choice != "auto" or reason == "tool_calls":
            assert reason == "tool_calls" and message["content"] is None, whole
            check_calls(message["tool_calls"], choice)
            calls_seen += 1
            if tool_format == "llama3_json":
                assert len(message["tool_calls"]) == 1
        else:
            assert message["tool_calls"] == [] and not message["content"].lstrip().startswith(("{", "["))
        content, calls, streamed_reason = streamed_message(ask(handler, seed, stream=True, tool_choice=choice))
        assert streamed_reason == reason and (content or "") == (message["content"] or "")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
               [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls_seen or choice == "auto"


def test_pythonic_parallel_calls_are_a_list_and_one_when_parallel_is_off(engine, compiler):
    handler = make_handler(engine, compiler, "pythonic")
    counts = set()
    for seed in range(6):
        for parallel in (True, False):
            reply = final_json(ask(handler, seed, tool_choice="required", parallel_tool_calls=parallel))
            calls = reply["choices"][0]["message"]["tool_calls"]
            check_calls(calls, "required")
            assert parallel or len(calls) == 1
            counts.add(len(calls))
    assert max(counts) >= 1


def test_a_reply_s_calls_and_their_results_go_back_into_the_history(engine, compiler):
    handler = make_handler(engine, compiler, "llama3_json")
    reply = final_json(ask(handler, 1, tool_choice="required"))["choices"][0]["message"]
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": reply["tool_calls"]},
                          {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": '{"ok": true}'}]
    again = final_json(run_to_end(handler, {"r": json.dumps({
        "messages": history, "tools": TOOLS, "tool_choice": "none", "max_tokens": 8, "temperature": 0}).encode()},
        paths=PATH)["r"])["choices"][0]
    assert again["finish_reason"] in ("stop", "length") and again["message"]["tool_calls"] == []


@pytest.mark.parametrize("fields,param,message", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": True}, "parallel_tool_calls", "one call per reply"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "either tools"),
    ({"tools": TOOLS, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"tools": TOOLS, "messages": MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "[" * 5000}}]}]},
     "messages", "nested too deeply"),
    ({"tools": [{"type": "function", "function": {"name": "loop", "parameters": {  # a call that could never end
        "type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/$defs/n"}},
        "$defs": {"n": {"$ref": "#/$defs/n"}}}}}]}, "tools", "no value meets this schema"),
])
def test_bad_tool_requests_are_refused_naming_the_field(engine, fields, param, message):
    body = json.dumps({"messages": MESSAGES, **fields}).encode()
    with pytest.raises(RequestError, match=message) as info:
        parse_openai(CHAT, {"body": body}, SETTINGS, engine.tokenizer, engine.args.vocab_size, "m", "r")
    assert info.value.param == param


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_the_native_api_refuses_tool_fields_beside_a_prompt_as_beside_messages(engine, fields, param):
    """docs/api.md: tools, tool_choice and parallel_tool_calls go with messages, and a wrongly typed field is a 400.
    Beside a prompt only `tools` was checked: a forced tool_choice was dropped without a word (the reply plain
    text, no call) and a parallel_tool_calls of any type passed. Each is the 400 it is beside messages."""
    for prompt in ({"messages": MESSAGES}, {"prompt": "Weather in Oslo?"}):
        body = json.dumps({**prompt, **fields}).encode()
        with pytest.raises(RequestError) as info:
            parse_request({"body": body}, SETTINGS, engine.tokenizer, engine.args.vocab_size)
        assert (info.value.param, info.value.status) == (param, 400), prompt


def test_a_parameter_schema_nested_past_what_the_pythonic_grammar_recurses_is_a_400(engine):
    """Building a pythonic call's rules recurses a few frames per level of a parameter's schema: arrays of arrays
    300 deep raised a RecursionError, which the handler answered as its own 500."""
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": deep}}}}]
    body = json.dumps({"messages": MESSAGES, "tools": tools}).encode()
    settings = dataclasses.replace(SETTINGS, tool_format="pythonic")
    with pytest.raises(RequestError, match="tools: a parameter schema is nested too deeply") as info:
        parse_openai(CHAT, {"body": body}, settings, engine.tokenizer, engine.args.vocab_size, "m", "r")
    assert info.value.param == "tools" and info.value.status == 400


@pytest.mark.parametrize("tool_format", ["llama3_json", "pythonic"])
def test_a_parameter_schema_the_grammar_cannot_enforce_is_a_400_naming_it(engine, compiler, tool_format):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}]
    body = json.dumps({"messages": MESSAGES, "tools": tools, "tool_choice": "required"}).encode()
    got = serve(make_handler(engine, compiler, tool_format), [[("r", body)]], PATH)["r"][0]
    error = json.loads(got[0])["error"]
    assert got[1].status[got[2]] == 400 and error["param"] == "tools" and "uniqueItems" in error["message"]


@pytest.mark.parametrize("name", ['say "hi"', "parameters"])
def test_a_json_call_is_read_past_its_name_streamed_or_whole(name):
    """A llama3_json tool's name may hold an escaped quote, or be "parameters" itself: the call keeps that
    name and its own arguments, fed a character at a time or read whole."""
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
        "n": {}}}}}]
    arguments = {"n": [1, {"k": "}{"}]}
    text = json.dumps({"name": name, "parameters": arguments})
    streamed = ToolReply(ToolUse(tools, "required", "llama3_json", False))
    deltas = [delta for char in text for delta in streamed.feed(char)[1]]
    assert deltas[0]["function"]["name"] == name
    assert json.loads("".join(d["function"].get("arguments", "") for d in deltas)) == arguments
    for reply in (streamed, ToolReply(ToolUse(tools, "required", "llama3_json", False))):
        content, calls, is_call = reply.finish(text)
        assert content is None and is_call and [c["function"]["name"] for c in calls] == [name]
        assert json.loads(calls[0]["function"]["arguments"]) == arguments


@pytest.mark.parametrize("tool_format,text", [
    ("pythonic", '\xa0[get_weather(city="Oslo")]'),
    ("llama3_json", '\x0c{"name": "get_weather", "parameters": {"city": 7}}'),
])
def test_a_call_after_other_whitespace_is_text_streamed_or_whole(text, tool_format):
    """Under "auto" the grammar holds to the tools only a reply that opens a call after spaces, tabs or line
    breaks; after a no-break space or a form feed the reply is free text (its arguments need not validate). The
    whole reply gives it as content: so must the stream, rather than deltas of a call that never parses."""
    streamed = ToolReply(ToolUse(TOOLS, "auto", tool_format, tool_format == "pythonic"))
    pieces = [streamed.feed(char) for char in text]
    content = "".join(piece for piece, _ in pieces) + streamed.flush() + streamed.cut_call()
    assert [delta for _, deltas in pieces for delta in deltas] == [] and content == text
    assert ToolReply(ToolUse(TOOLS, "auto", tool_format, False)).finish(text) == (text, [], False)


def test_a_llama2_checkpoint_refuses_tools(synthetic_checkpoint):
    from tp_llama.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(synthetic_checkpoint("llama2", mp=1) / "tokenizer.model")
    body = json.dumps({"messages": MESSAGES, "tools": TOOLS}).encode()
    with pytest.raises(RequestError, match="Llama 2") as info:
        parse_openai(CHAT, {"body": body}, SETTINGS, tokenizer, 512, "m", "r")
    assert info.value.param == "tools"


def test_tool_choice_none_adds_no_grammar_and_answers_in_text(engine, compiler):
    handler = make_handler(engine, compiler, "pythonic")
    got = serve(handler, [[("r", json.dumps({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none",
                                              "max_tokens": 4, "temperature": 0}).encode())]], PATH)
    assert "r" not in handler.compiling and got["r"]


def test_the_native_api_answers_tool_calls_too(engine, compiler):
    handler = make_handler(engine, compiler, "llama3_json")
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_new_tokens": 120,
            "temperature": 1.0, "seed": 6}
    whole = final_json(run_to_end(handler, {"r": json.dumps(body).encode()})["r"])
    assert whole["finish_reason"] == "tool_calls"
    check_calls(whole["tool_calls"], "required")
    lines = [json.loads(line) for piece, _, _ in run_to_end(handler, {"r": json.dumps({**body, "stream": True})
                                                                     .encode()})["r"] for line in piece.splitlines()]
    assert "".join(line["text"] for line in lines) == whole["text"]
    assert lines[-1]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in lines[-1]["tool_calls"]] == [c["function"] for c in whole["tool_calls"]]



# Python reads identifiers NFKC-normalized: the micro sign as Greek mu, the "fi" ligature as "f" "i".
DOSE = {"type": "function", "function": {
    "name": "\ufb01nd_dose", "description": "A dose in micrograms",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["\u00b5g"],
                   "properties": {"\u00b5g": {"type": "integer", "minimum": 0, "maximum": 9}}}}}


def test_a_pythonic_call_keeps_the_tool_s_names_as_written(engine, compiler):
    """A name that Python's reader normalizes (a tool "ﬁnd_dose", a parameter "µg") is the tool's own in the
    reply: a forced call is a call of that tool, its arguments valid against its schema, streamed or not."""
    handler = make_handler(engine, compiler, "pythonic")
    named = {"type": "function", "function": {"name": DOSE["function"]["name"]}}
    for seed in range(2):
        fields = {"tools": [DOSE], "tool_choice": named, "parallel_tool_calls": False, "max_tokens": 60}
        whole = final_json(ask(handler, seed, **fields))["choices"][0]
        assert whole["finish_reason"] == "tool_calls", whole
        call = whole["message"]["tool_calls"][0]["function"]
        assert call["name"] == DOSE["function"]["name"]
        jsonschema.validate(json.loads(call["arguments"]), DOSE["function"]["parameters"])
        _, calls, reason = streamed_message(ask(handler, seed, stream=True, **fields))
        assert reason == "tool_calls" and [c["function"] for c in calls] == [call]



def streamed_choices(handler, **fields) -> dict[int, dict]:
    """Each choice's streamed content, tool-call deltas and finish reason."""
    out: dict[int, dict] = {}
    for piece, _, _ in ask(handler, 1, stream=True, **fields):
        for line in piece.splitlines():
            for choice in json.loads(line[6:])["choices"] if line.startswith("data: {") else []:
                got = out.setdefault(choice["index"], {"content": "", "calls": [], "finish": None})
                got["content"] += choice["delta"].get("content") or ""
                got["calls"] += choice["delta"].get("tool_calls") or []
                got["finish"] = choice["finish_reason"] or got["finish"]
    return out


@pytest.mark.parametrize("tool_format", ["llama3_json", "pythonic"])
def test_a_streamed_call_cut_by_max_tokens_is_content_until_a_call_delta_went_out(engine, compiler, tool_format):
    """A forced call cut short is no call: the whole reply gives its text as content, and so does a stream cut
    before any call's name was complete (once, though the other choice goes on after it). A stream cut after a
    call's delta went out keeps to the calls it sent: no content, finish_reason "length" (vLLM's way)."""
    handler = make_handler(engine, compiler, tool_format)
    whole = final_json(ask(handler, 1, tool_choice="required", max_tokens=200, n=2))["choices"]
    assert all(c["finish_reason"] == "tool_calls" and c["message"]["tool_calls"] for c in whole)
    seen = set()
    for max_tokens in range(2, 40, 6):
        cut = final_json(ask(handler, 1, tool_choice="required", max_tokens=max_tokens, n=2))["choices"]
        streamed = streamed_choices(handler, tool_choice="required", max_tokens=max_tokens, n=2)
        for choice, full in zip(cut, whole):
            if choice["finish_reason"] != "length":
                continue  # this choice's call was whole by then
            got = streamed[choice["index"]]
            assert got["finish"] == "length" and choice["message"]["tool_calls"] == []
            seen.add(bool(got["calls"]))
            if not got["calls"]:
                assert got["content"] == choice["message"]["content"] != ""
                continue
            assert got["content"] == "" and got["calls"][0]["function"]["name"] == full["message"]["tool_calls"][0][
                "function"]["name"]
            sent = "".join(d["function"].get("arguments", "") for d in got["calls"] if d["index"] == 0)
            assert full["message"]["tool_calls"][0]["function"]["arguments"].startswith(sent)
    assert seen == {False, True}  # cut before a call's delta went out, and after
