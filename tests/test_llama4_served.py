"""Llama 4 served end to end: one TorchServe at TP 2 over a small random Llama 4 checkpoint in Meta's
download layout (MP 2, with the entries a loader drops) and Meta's real 202,048-id tokenizer, so the
server reads and writes real chat text in Llama 4's format.

Through the OpenAI chat path: a seeded reply streamed and whole; tools in Llama 4's format (the prompt
read back through the tokenize route and decoded by Meta's own tokenizer, and a call forced by a
named tool_choice, whose raw text is parsed here as the Python list it is); a JSON-schema reply checked
by `jsonschema`; an image part refused as text-only while the server goes on serving. The expected
texts come from Meta's prompt guide and tokenizer (llama-models), never from the code under test.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import jsonschema
import pytest

from tests.support.meta_llama4 import META_VOCAB, small_params, write_llama4_checkpoint
from tests.support.serving_util import Reply, TorchServe

# dim 64 keeps the 202,048-row embedding and output layer at 52 MB each in float32; 4 heads over 2 KV
# heads split at TP 2, as the dense and expert FFN widths (224, 128) do.
PARAMS = small_params(vocab_size=META_VOCAB, dim=64, n_heads=4, n_kv_heads=2)
CHAT = "/predictions/llama/1.0/v1/chat/completions"
TIMEOUT = 60  # per request: a reply of these lengths takes a second or two at TP 2 on CPU
QUESTION = [{"role": "user", "content": "What is the weather in Oslo this week?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city, day by day.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city.",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
KEEPER = {"type": "object", "additionalProperties": False, "required": ["name", "watch"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "watch": {"enum": ["dawn", "dusk"]},
                         "years": {"type": "integer", "minimum": 1, "maximum": 40}}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama4-served") / "ckpt"
    write_llama4_checkpoint(folder, PARAMS, 2, seed=9, extra_entries=True)
    return folder


@pytest.fixture(scope="module")
def server(checkpoint: Path, serve):
    # Room for Llama 4's tool rules in the prompt, prefilled in two steps.
    with serve(checkpoint, max_seq_len=1024, prefill_budget=512, default_max_new_tokens=24) as ts:
        yield ts


@pytest.fixture(scope="module")
def meta_tokenizer(checkpoint: Path):
    """Meta's own Llama 4 tokenizer on the file the server reads."""
    from llama_models.llama4.tokenizer import Tokenizer

    return Tokenizer(checkpoint / "tokenizer.model")


def post(server: TorchServe, path: str, body: dict) -> Reply:
    return server.request("POST", path, json.dumps(body).encode(), timeout=TIMEOUT)


def chat(server: TorchServe, **body: object) -> dict:
    reply = post(server, CHAT, {"messages": QUESTION, **body})
    assert reply.status == 200, reply.body[:500]
    return reply.json()


def streamed_chat(server: TorchServe, **body: object) -> list[dict]:
    """The chunks of a streamed chat reply, which must end with `data: [DONE]`."""
    reply = post(server, CHAT, {"messages": QUESTION, "stream": True, **body})
    assert reply.status == 200, reply.body[:500]
    events = [line[len("data: "):] for line in reply.body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(event) for event in events[:-1]]


def test_a_seeded_chat_reply_is_the_same_streamed_and_whole(server: TorchServe) -> None:
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 24}
    whole = chat(server, **sampled)["choices"][0]
    chunks = streamed_chat(server, **sampled)
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert whole["message"]["content"], "an empty reply would make the comparison vacuous"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    other = chat(server, **{**sampled, "seed": 12})["choices"][0]["message"]["content"]
    assert other != whole["message"]["content"], "the seed did not reach the sampler"


def test_tools_get_llama4s_prompt_and_a_forced_call_comes_back_as_tool_calls(server: TorchServe,
                                                                              meta_tokenizer) -> None:
    tools = {"tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    tokenized = post(server, "/predictions/llama/1.0/tokenize", {"messages": QUESTION, **tools})
    assert tokenized.status == 200, tokenized.body[:500]
    prompt = meta_tokenizer.decode(tokenized.json()["tokens"])
    # Meta's Llama 4 prompt guide: its tool rules in a system turn, the turns in <|header_start|> headers.
    assert prompt.startswith("<|begin_of_text|><|header_start|>system<|header_end|>\n\nYou are a helpful assistant "
                             "and an expert in function composition.")
    assert "- Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]" in prompt
    assert all(name in prompt for name in ("get_weather", "The forecast for a city, day by day.", "get_time"))
    assert prompt.endswith("<|eot|><|header_start|>user<|header_end|>\n\nWhat is the weather in Oslo this week?"
                           "<|eot|><|header_start|>assistant<|header_end|>\n\n")

    got = chat(server, **tools, temperature=0, max_tokens=60, return_token_ids=True)
    assert got["usage"]["prompt_tokens"] == tokenized.json()["count"], "the chat path built another prompt"
    choice = got["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    calls = choice["message"]["tool_calls"]
    assert [call["function"]["name"] for call in calls] == ["get_weather"]
    arguments = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    # The model's own text is a Python list of calls, as Meta's format writes it: parsed here by Python.
    text = meta_tokenizer.decode([t for t in choice["token_ids"] if t not in meta_tokenizer.stop_tokens])
    (written,) = ast.parse(text.strip(), mode="eval").body.elts
    assert ast.unparse(written.func) == "get_weather"
    assert {k.arg: ast.literal_eval(k.value) for k in written.keywords} == arguments


def test_a_json_schema_reply_validates(server: TorchServe) -> None:
    format_ = {"type": "json_schema", "json_schema": {"name": "keeper", "schema": KEEPER, "strict": True}}
    for seed in (1, 2):
        choice = chat(server, response_format=format_, temperature=1.0, seed=seed, max_tokens=120)["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), KEEPER)


def test_an_image_part_is_refused_as_text_only_and_the_server_serves_on(server: TorchServe) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    asked = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image]}]
    reply = post(server, CHAT, {"messages": asked, "max_tokens": 8})
    assert reply.status == 400, reply.body[:500]
    error = reply.json()["error"]
    assert error["param"] == "messages" and "image_url" in error["message"] and "text-only" in error["message"]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}]}]
    after = post(server, CHAT, {"messages": text_only, "max_tokens": 8, "temperature": 0})
    assert after.status == 200 and after.json()["choices"][0]["message"]["content"], after.body[:500]
