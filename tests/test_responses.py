"""OpenAI's Responses API (/v1/responses) and vLLM's tokenizer endpoints through the handler, call by call,
over a one-process engine on random weights (tests/test_openai.py serves both through TorchServe).

The official `openai` client's own types are the judge of every reply and every streamed event
(`Response.model_validate`, the stream-event union); the chat completions path is the judge of the
prompt, the tokens and their log-probabilities: the same conversation must give the same ones.
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from tests.support.hostile_corpus import hostile_corpus
from tests.support.hostile_responses import hostile_responses, hostile_tokenizer_bodies
from tests.test_handler_unit import final_json, new_handler, run_to_end
from tests.test_tool_calls import MAX_SEQ_LEN, compiler, engine  # noqa: F401 (the same engine and grammar compiler)
from tp_llama.config import EngineConfig
from tp_llama.engine.constraint import grammar_tokenizer
from tp_llama.serving.grammars import GrammarCompiler
from tp_llama.serving.openai_api import error_body
from tp_llama.serving.request import RequestError
from tp_llama.serving.responses_api import parse_responses
from tp_llama.serving.routes import answer_now
from tp_llama.serving.settings import HandlerSettings

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

EVENTS = TypeAdapter(ResponseStreamEvent)
RESPONSES, CHAT = "v1/responses", "v1/chat/completions"
SETTINGS = HandlerSettings(EngineConfig("/ckpt", max_seq_len=MAX_SEQ_LEN), default_max_new_tokens=24,
                           max_new_tokens_limit=200, temperature=1.0, top_p=1.0, max_request_bytes=65536)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}}}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
KEEPER = {"type": "object", "additionalProperties": False, "required": ["name", "watch"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "watch": {"enum": ["dawn", "dusk"]}}}


def handler_for(engine, compiler, tool_format: str = "pythonic"):
    return new_handler(engine, dataclasses.replace(SETTINGS, tool_format=tool_format), compiler)


def ask(handler, requests: dict[str, tuple[str, dict]]) -> dict[str, list]:
    """Each request id's replies: {id: (path, body)}."""
    return run_to_end(handler, {rid: json.dumps(body).encode() for rid, (_, body) in requests.items()},
                      paths={rid: path for rid, (path, _) in requests.items()})


def events_of(replies: list) -> list[dict]:
    """The streamed events, each validated by the client's own types; their sequence numbers count from 0."""
    text = "".join(reply for reply, _, _ in replies)
    events = []
    for block in filter(None, text.split("\n\n")):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def streamed_output(events: list[dict]) -> tuple[str, list, dict[str, str]]:
    """What a client puts together from the deltas: the text, its log-probabilities, each call's arguments."""
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    logprobs = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    arguments: dict[str, str] = {}
    for e in events:
        if e["type"] == "response.function_call_arguments.delta":
            arguments[e["item_id"]] = arguments.get(e["item_id"], "") + e["delta"]
    return text, logprobs, arguments


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


CONVERSATION = {"instructions": "Be brief.", "input": [
    {"role": "user", "content": "Hi there"}, {"type": "message", "role": "assistant",
                                              "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
    {"role": "user", "content": [{"type": "input_text", "text": "Tell me "}, {"type": "input_text", "text": "more"}]}]}
CHAT_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                 {"role": "assistant", "content": "Hello."},
                 {"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "more"}]}]


def test_a_response_equals_the_chat_completion_plain_streamed_and_cut(engine, compiler) -> None:
    """Greedy, the same conversation gives the same text and log-probabilities through both APIs; the reply
    and every event validate; the deltas add up to the reply; max_output_tokens cuts it as incomplete."""
    greedy = {"temperature": 0, "top_logprobs": 2, "include": ["message.output_text.logprobs"]}
    requests = {"chat": (CHAT, {"messages": CHAT_MESSAGES, "max_tokens": 12, "temperature": 0, "logprobs": True,
                                "top_logprobs": 2}),
                "plain": (RESPONSES, {**CONVERSATION, **greedy, "max_output_tokens": 12, "metadata": {"k": "v"},
                                      "store": False, "truncation": "disabled", "user": "u", "seed": 3}),
                "stream": (RESPONSES, {**CONVERSATION, **greedy, "max_output_tokens": 12, "stream": True})}
    replies = ask(handler_for(engine, compiler), requests)
    chat = final_json(replies["chat"])
    plain = final_json(replies["plain"])
    Response.model_validate(plain)
    assert plain["object"] == "response" and plain["id"].startswith("resp_") and plain["metadata"] == {"k": "v"}
    message = chat["choices"][0]
    assert output_text(plain) == message["message"]["content"]
    assert plain["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert plain["usage"]["output_tokens"] == chat["usage"]["completion_tokens"] == 12
    assert plain["status"] == "incomplete" and plain["incomplete_details"] == {"reason": "max_output_tokens"}
    assert plain["output"][0]["status"] == "incomplete"
    logprobs = plain["output"][0]["content"][0]["logprobs"]
    assert [(e["token"], e["logprob"]) for e in logprobs] == \
        [(e["token"], pytest.approx(e["logprob"], abs=1e-5)) for e in message["logprobs"]["content"]]
    assert all(len(e["top_logprobs"]) == 2 for e in logprobs)
    events = events_of(replies["stream"])
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    text, streamed_logprobs, _ = streamed_output(events)
    final = events[-1]["response"]
    assert text == output_text(final) == output_text(plain)
    assert [e["logprob"] for e in streamed_logprobs] == pytest.approx([e["logprob"] for e in logprobs], abs=1e-5)
    assert events[-4]["text"] == text and final["usage"] == plain["usage"]


def test_a_reply_that_ends_is_completed(engine, compiler) -> None:
    replies = ask(handler_for(engine, compiler), {
        "r": (RESPONSES, {"input": "Say yes", "text": {"format": {"type": "json_schema", "name": "k",
                                                                   "schema": {"enum": ["yes", "no"]}}}})})
    reply = final_json(replies["r"])
    Response.model_validate(reply)
    assert reply["status"] == "completed" and reply["incomplete_details"] is None
    assert json.loads(output_text(reply)) in ("yes", "no") and reply["output"][0]["status"] == "completed"


def test_a_reply_whose_grammar_fails_is_failed_and_says_so(engine, compiler, monkeypatch) -> None:
    """A matcher that fails mid-reply (llguidance's limits, injected here) ends the sequence as "error": the
    response is failed with an error naming the grammar, not completed; chat's finish_reason is "error"."""
    from tp_llama.engine.constraint import Constraint

    monkeypatch.setattr(Constraint, "advance", lambda self, tokens: False)
    monkeypatch.setattr(Constraint, "failed", property(lambda self: True))
    monkeypatch.setattr(Constraint, "error", property(lambda self: "injected"))
    fmt = {"type": "json_schema", "name": "keeper", "schema": KEEPER}
    replies = ask(handler_for(engine, compiler), {
        "r": (RESPONSES, {"input": "Who keeps the light?", "text": {"format": fmt}}),
        "c": (CHAT, {"messages": [{"role": "user", "content": "Who?"}], "response_format": {
            "type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}})})
    reply = final_json(replies["r"])
    Response.model_validate(reply)
    assert reply["status"] == "failed" and "grammar failed" in reply["error"]["message"], reply
    assert [item["status"] for item in reply["output"]] == ["incomplete"]
    assert final_json(replies["c"])["choices"][0]["finish_reason"] == "error"


def test_text_format_json_schema_and_json_object_constrain_the_reply(engine, compiler) -> None:
    handler = handler_for(engine, compiler)
    schema = {"type": "json_schema", "name": "keeper", "schema": KEEPER, "strict": True}
    requests = {f"s{seed}": (RESPONSES, {"input": "Who keeps the light?", "max_output_tokens": 120, "seed": seed,
                                         "text": {"format": schema}, "stream": seed == 1}) for seed in range(3)}
    requests["o"] = (RESPONSES, {"input": "An object", "max_output_tokens": 120, "seed": 9,
                                 "text": {"format": {"type": "json_object"}}})
    replies = ask(handler, requests)
    for seed in range(3):
        reply = events_of(replies["s1"])[-1]["response"] if seed == 1 else final_json(replies[f"s{seed}"])
        assert reply["status"] == "completed" and reply["text"]["format"]["name"] == "keeper"
        jsonschema.validate(json.loads(output_text(reply)), KEEPER)
    assert isinstance(json.loads(output_text(final_json(replies["o"]))), dict)


@pytest.mark.parametrize("tool_format", ["pythonic", "llama3_json"])
def test_function_tools_are_called_and_the_round_trip_is_the_chat_prompt(engine, compiler, tool_format) -> None:
    """A forced call is a function_call item whose arguments validate, whole and streamed; sending it back
    with its output gives the prompt chat completions builds from the same history."""
    handler = handler_for(engine, compiler, tool_format)
    ask_call = {"input": "Weather in Oslo?", "tools": [WEATHER], "max_output_tokens": 120, "seed": 2,
                "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False}
    replies = ask(handler, {"w": (RESPONSES, ask_call), "s": (RESPONSES, {**ask_call, "stream": True})})
    whole = final_json(replies["w"])
    Response.model_validate(whole)
    (call,) = whole["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])
    assert whole["tool_choice"] == ask_call["tool_choice"] and whole["parallel_tool_calls"] is False
    events = events_of(replies["s"])
    _, _, arguments = streamed_output(events)
    (streamed,) = events[-1]["response"]["output"]
    assert arguments == {streamed["id"]: streamed["arguments"]} and streamed["arguments"] == call["arguments"]
    assert [e for e in events if e["type"] == "response.function_call_arguments.done"][0]["arguments"] == \
        call["arguments"]
    back = [{"role": "user", "content": "Weather in Oslo?"}, call,
            {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 21 C"}]
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call["call_id"], "type": "function",
                    "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
               {"role": "tool", "tool_call_id": call["call_id"], "content": "Sunny, 21 C"}]
    replies = ask(handler, {"r": (RESPONSES, {"input": back, "tools": [WEATHER], "tool_choice": "none",
                                              "max_output_tokens": 8, "temperature": 0}),
                            "c": (CHAT, {"messages": history, "tools": [CHAT_WEATHER], "tool_choice": "none",
                                         "max_tokens": 8, "temperature": 0})})
    again, chat = final_json(replies["r"]), final_json(replies["c"])
    Response.model_validate(again)
    assert again["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert output_text(again) == chat["choices"][0]["message"]["content"]


def test_parallel_calls_stream_one_item_after_another(engine, compiler) -> None:
    """Each item's events, from output_item.added to output_item.done, come before the next item is added, as
    the API streams them; an item done as completed stays so in the response, though a later call is cut."""
    clock = {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "required": ["zone"], "properties": {"zone": {"type": "integer"}}}}
    handler, shapes = handler_for(engine, compiler), set()
    for seed in range(4):
        for limit in (150, 14, 20, 30):
            events = events_of(ask(handler, {"s": (RESPONSES, {
                "input": "Weather in Oslo?", "tools": [WEATHER, clock], "tool_choice": "required", "seed": seed,
                "max_output_tokens": limit, "stream": True})})["s"])
            items = [e["output_index"] for e in events if "output_index" in e]
            assert items == sorted(items), [(e["type"], e.get("output_index")) for e in events]
            done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
            assert done == events[-1]["response"]["output"]
            shapes.add(tuple(item["status"] for item in done))
    assert ("completed", "completed") in {shape[:2] for shape in shapes}  # a reply of several calls was seen


@pytest.mark.parametrize("body, param, message", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "keeps no responses"),
    ({"input": "hi", "background": True}, "background", "keeps no responses"),
    ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning", "reasoning settings are not supported"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "'web_search' tools are not supported"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools", "'file_search'"),
    ({"input": "hi", "tools": [{"type": "code_interpreter", "container": {}}]}, "tools", "'code_interpreter'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0].content[0]: input_image parts are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input", "input_audio"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference needs stored items"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "reasoning items are not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "input", "no function_call"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role must be one of"),
    ({"input": ""}, "input", "non-empty"),
    ({"input": []}, "input", "non-empty"),
    ({}, "input", "non-empty"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include", "'reasoning.encrypted_content'"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "never cut"),
    ({"input": "hi", "max_output_tokens": 201}, "max_output_tokens", "max_output_tokens 201 exceeds the limit 200"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be >= 1"),
    ({"input": "hi", "temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20]"),
    ({"input": "hi", "stop": ["x"]}, "stop", "Unrecognized request argument supplied: stop"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "u",
                                         "schema": {"type": "array", "uniqueItems": True}}}}, "text.format",
     "text.format: the schema cannot be enforced"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "u", "schema": 3}}}, "text",
     "text.format.schema must be a JSON schema"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text", "text.format.type must be"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice",
     "'nope', which is not among the tools"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice", "'file_search' is not supported"),
    ({"input": "hi", "tools": [WEATHER, WEATHER]}, "tools", "two tools are named"),
    ({"input": "hi", "seed": -1}, "seed", "seed must be in [0, 2**63)"),
    ({"input": "hi", "tools": [{**WEATHER, "parameters": {**WEATHER["parameters"], "required": 1}}]}, "tools",
     "required must be an array of strings"),
    ({"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "object", "properties": {
        "days": {"type": "array", "minItems": "2"}}}}]}, "tools", "'minItems' and 'maxItems' must be"),
    ({"instructions": "x", "input": [{"role": "user", "content": "u"}, {"type": "function_call", "call_id": "c",
                                                                        "name": "get_weather", "arguments": "{"}],
      "tools": [WEATHER]}, "input", "input[1].arguments is not JSON"),
    ({"input": [{"role": "user", "content": "u"}, {"type": "function_call", "call_id": "c", "name": "get_weather",
                                                  "arguments": "[" * 5000}], "tools": [WEATHER]}, "input",
     "input[1].arguments is nested too deeply"),
    ({"instructions": "x", "input": [{"role": "user", "content": "u"}, {"type": "function_call", "call_id": "c",
                                                                        "name": "f", "arguments": "{}"}]},
     "input", "input[1]: function_call items need the request's tools"),
    ({"input": [{"role": "user", "content": "u"}, {"type": "function_call", "call_id": "c", "name": "get_weather",
                                                  "arguments": '{"city": 1' + "0" * 5000 + "}"}], "tools": [WEATHER]},
     "input", "input[1].arguments holds a number too long to read"),  # json.loads' bare ValueError: was a 500
])
def test_refusals_name_the_field(engine, body: dict, param: str, message: str) -> None:
    settings = dataclasses.replace(SETTINGS, tool_format="pythonic")
    grammar_refused = param == "text.format"
    with pytest.raises(RequestError) as info:
        reply = parse_responses({"body": json.dumps(body).encode()}, settings, engine.tokenizer, 512, "m", "r", 0)
        if grammar_refused:  # compiled when the request is admitted: the compiler's own refusal
            GrammarCompiler(grammar_tokenizer(engine.tokenizer)).compile_now(reply.job.grammar)
    assert message in str(info.value) and info.value.status == 400 and info.value.param == param, str(info.value)
    assert set(error_body(info.value)["error"]) == {"message", "type", "param", "code"}


def test_a_tool_holding_a_number_past_float_s_range_is_refused(engine) -> None:
    """1e999 reads as infinity, and the reply echoes the tools: it wrote Infinity, which is no JSON."""
    settings = dataclasses.replace(SETTINGS, tool_format="pythonic")
    body = (b'{"input": "hi", "tool_choice": "none", "tools": [{"type": "function", "name": "f", "parameters": '
            b'{"type": "object", "properties": {"a": {"type": "number", "default": 1e999}}}}]}')
    with pytest.raises(RequestError, match=r"tools\[0\] holds a number out of range") as info:
        parse_responses({"body": body}, settings, engine.tokenizer, 512, "m", "r", 0)
    assert info.value.param == "tools" and info.value.status == 400


def test_hostile_bodies_are_400s_on_the_new_paths(engine) -> None:
    """The native hostile corpus, and bodies made hostile field by field from valid Responses and tokenizer
    requests, are each a 400 naming the problem on every new path, never an internal error."""
    settings = dataclasses.replace(SETTINGS, tool_format="pythonic")
    native = hostile_corpus(seed=3, max_seq_len=MAX_SEQ_LEN, max_body=65536, server_cap=262144)
    cases = [(RESPONSES, c.body) for c in native[::3]] + [(RESPONSES, b) for b in hostile_responses()]
    framing = [c.body for c in native if c.category in ("random bytes", "deep JSON", "huge JSON", "invalid UTF-8")]
    cases += hostile_tokenizer_bodies() + [(path, body) for body in framing[::3] for path in ("tokenize", "detokenize")]
    assert len(cases) > 300
    for path, body in cases:
        with pytest.raises(RequestError) as info:
            if path == RESPONSES:
                parse_responses({"body": body}, settings, engine.tokenizer, 512, "m", "r", 0)
            else:
                answer_now(path, {"body": body}, settings, engine.tokenizer, "m")
        assert info.value.status == 400, (path, body[:160], str(info.value))


def test_tokenizer_endpoints_answer_as_vllm_and_as_lm_eval_reads_them(engine, compiler) -> None:
    tokenizer = engine.tokenizer
    handler = handler_for(engine, compiler)
    info_request = {"i": None}
    replies = run_to_end(handler, info_request, paths={"i": "tokenizer_info"})
    info = final_json(replies["i"])
    assert info["eos_token"] == "<|end_of_text|>" and info["bos_token"] == "<|begin_of_text|>"
    assert (info["eos_token_id"], info["bos_token_id"], info["model_max_length"]) == (
        tokenizer.eos_id, tokenizer.bos_id, MAX_SEQ_LEN)
    text = "Grüße <|eot_id|> and more"
    asks = {"plain": ("tokenize", {"prompt": text}),
            "bare": ("tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}),
            "eos": ("tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}),
            "chat": ("tokenize", {"messages": CHAT_MESSAGES}),
            "chat_tools": ("tokenize", {"messages": CHAT_MESSAGES, "tools": [CHAT_WEATHER]}),
            "c": (CHAT, {"messages": CHAT_MESSAGES, "max_tokens": 1}),
            "ct": (CHAT, {"messages": CHAT_MESSAGES, "tools": [CHAT_WEATHER], "max_tokens": 1, "tool_choice": "none"}),
            "bad": ("tokenize", {"prompt": "x", "add_special_tokens": "yes"}),
            "unknown": ("v1/embeddings", {"input": "x"})}
    got = {rid: final_json(r) for rid, r in ask(handler, asks).items()}
    eot = tokenizer.special_ids["<|eot_id|>"]
    before, after = tokenizer.encode("Grüße ", bos=False), tokenizer.encode(" and more", bos=False)
    assert got["bare"]["tokens"] == before + [eot] + after and got["bare"]["count"] == len(got["bare"]["tokens"])
    assert got["plain"]["tokens"] == [tokenizer.bos_id] + got["bare"]["tokens"]
    assert got["bare"]["token_strs"] == [tokenizer.decode([t]) for t in got["bare"]["tokens"]]
    assert got["plain"]["max_model_len"] == MAX_SEQ_LEN and got["plain"]["token_strs"] is None
    assert got["eos"]["tokens"] == [tokenizer.eos_id]  # lm-eval's eos_token_id: tokenize(eos_token)[0]
    assert got["chat"]["count"] == got["c"]["usage"]["prompt_tokens"]
    assert got["chat_tools"]["count"] == got["ct"]["usage"]["prompt_tokens"] > got["chat"]["count"]
    assert got["bad"]["error"]["param"] == "add_special_tokens"
    assert "tokenize" in got["unknown"]["error"]["message"] and "v1/responses" in got["unknown"]["error"]["message"]
    back = final_json(ask(handler, {"d": ("detokenize", {"tokens": got["plain"]["tokens"]})})["d"])
    assert back == {"prompt": tokenizer.decode(got["plain"]["tokens"])}
    refused = final_json(ask(handler, {"d": ("detokenize", {"tokens": [10**6]})})["d"])
    assert refused["error"]["param"] == "tokens"
