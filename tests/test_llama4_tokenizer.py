"""Llama 4's tokenizer, chat template and tool calls against Meta's own code (llama-models 0.3.0, test-only).

The oracle is ``llama_models.llama4``: its ``Tokenizer`` on the real Llama 4 ``tokenizer.model`` it ships
(ids, special tokens, split pattern), its ``ChatFormat`` (dialogs, tool calls written with
``ToolPromptFormat.python_list``, tool results) and its reply decoder, and the tool-calling example of
Meta's Llama 4 prompt format, typed in below from the page.
"""

from __future__ import annotations

import base64
import importlib.resources
import importlib.util
import json
import random
import re
import sys
import types
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher
from llguidance.tiktoken import lltokenizer_from_encoding

from tests.support.meta_reference import INSTALL_HINT
from tp_llama.llama4_format import is_llama4_params
from tp_llama.serving.request import RequestError
from tp_llama.serving.tool_use import ToolReply, ToolUse, chat_ids, resolve_tool_format, tool_use
from tp_llama.tokenizer import Llama4Tokenizer, load_tokenizer
from tp_llama.tool_calls import parse_tool_calls, tool_call_grammar
from tp_llama.tool_format import encode_tool_chat

FMT = "llama4_pythonic"


@pytest.fixture(scope="module")
def model_path() -> Path:
    try:
        path = Path(str(importlib.resources.files("llama_models.llama4") / "tokenizer.model"))
    except ImportError:
        pytest.fail(INSTALL_HINT)
    assert path.is_file(), f"llama_models ships no Llama 4 tokenizer.model at {path}"
    return path


@pytest.fixture(scope="module")
def meta(model_path):
    from llama_models.llama4.tokenizer import Tokenizer

    return Tokenizer(model_path)


@pytest.fixture(scope="module")
def tok(model_path) -> Llama4Tokenizer:
    tok = load_tokenizer(model_path)
    assert isinstance(tok, Llama4Tokenizer) and tok.family == "llama4"
    return tok


@pytest.fixture(scope="module")
def chat_format(meta):
    """Meta's Llama 4 ChatFormat. Its module imports the image preprocessing (torchvision), which a text
    dialog never reaches: without torchvision, a stand-in for that one module is there while it loads."""
    name = "llama_models.llama4.preprocess"
    if importlib.util.find_spec("torchvision") is None and name not in sys.modules:
        stub = types.ModuleType(name)
        stub.ResizeNormalizeImageTransform = stub.VariableSizeImageTransform = None
        sys.modules[name] = stub
        try:
            from llama_models.llama4.chat_format import ChatFormat
        finally:
            del sys.modules[name]
    else:
        from llama_models.llama4.chat_format import ChatFormat
    return ChatFormat(meta)


# ---------------------------------------------------------------------------------------------
# The tokenizer


def test_special_tokens_pattern_and_stops_are_metas(tok, meta):
    assert tok.n_words == meta.n_words == 202_048
    assert tok.special_ids == meta.special_tokens  # all 2,048 names and ids
    assert tok.split_pattern == meta.O200K_PATTERN
    assert (tok.bos_id, tok.eos_id) == (meta.bos_id, meta.eos_id) == (200_000, 200_001)
    assert tok.stop_ids == frozenset(meta.stop_tokens)
    assert {tok.special_ids["<|eot|>"], tok.special_ids["<|eom|>"]} == {meta.eot_id, meta.eom_id}


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "camelCaseWords, HTTPServer, XMLHttpRequest, iPhone, McDonald's, ALLCAPS words",
    "I'm, you're, THEY'LL, it'S, don't, we'd, I've '''' 's",
    "Café crème, naïve façade, Zürich, São Paulo, Łódź, Ångström, e\u0301 A\u030a ǅ ﬁ İstanbul ß ẞ",
    "你好，世界！這是一個測試。東京タワーの高さは333メートルです。中文没有空格的长句子混合English和12345。",
    "مرحبا بالعالم — שלום עולם — नमस्ते दुनिया — สวัสดีชาวโลก — 안녕하세요 세계",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 tone, 🇯🇵🇺🇸 flags, 1️⃣ keycap, 🦙🦙🦙",
    "1234567890 3.14159265358979 0000000 12,345,678 1e-10 0x7fff_ffff ١٢٣٤٥ ½ ² Ⅻ ①",
    "x = 10**100 + 123456789012345678901234567890",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\nprint(f(3))\n",
    "see https://example.com/a/b//c and a/b/c/ and ../../etc/passwd and ;;//\n/",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "a  b   c    d     e\t\t\tindented\t\ttabs\t" + " " * 17 + "x" + " " * 17,
    "\n\n\n\n\nx\n\n line\r\n\r\nline\rline",
    "\u00a0\u2003\u3000 mixed \u2009 spaces \u200b zero-width odd\x0b\x0c\x1c\x1d\x85\u2028\u2029 \x00\x01\x7f",
    "<|eot|>",
    "<|begin_of_text|><|header_start|>user<|header_end|>\n\nhi<|eot|><|eom|>",
    "<|python_start|>print(1)<|python_end|> <|image|> <|patch|> <|reserved_special_token_903|>",
    "<|eot_id|><|start_header_id|><|python_tag|> (Llama 3's names) <| eot |> <|EOT|> <<|eot|>>",
    "supercalifragilisticexpialidocious" * 3,
    "a" * 30_001,  # a run Meta cuts at 25,000 characters
    "",
]


@pytest.mark.parametrize("text", TEXTS, ids=[f"text{i}" for i in range(len(TEXTS))])
def test_encode_and_decode_match_meta(tok, meta, text):
    for bos in (False, True):
        for eos in (False, True):
            assert tok.encode(text, bos=bos, eos=eos) == meta.encode(text, bos=bos, eos=eos), (bos, eos)
    ids = meta.encode(text, bos=False, eos=False)
    assert tok.decode(ids) == meta.decode(ids) == text
    assert not set(ids) & set(meta.special_tokens.values()), "a special token's name in text stayed text"


def test_fuzzed_texts_match_meta(tok, meta):
    rng = random.Random(4)
    alphabet = list("aZé1 9!'./,-_\n\r\t\x0b\xa0\u3000\u2028<|>🦙👍🏽\u200d日本ßİ") + [
        " the", "'s", "'LL", "Ab", "cD", ".\n", "/\n", "<|eot|>", "<|header_start|>", "  ", "123", "\r\n"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
        assert tok.encode(text, bos=False) == meta.encode(text, bos=False, eos=False), repr(text)


def test_decode_of_special_and_partial_ids_matches_meta(tok, meta):
    emoji = meta.encode("🦙 ok", bos=False, eos=False)
    specials = [meta.special_tokens[n] for n in ("<|header_start|>", "<|eot|>", "<|python_start|>",
                                                 "<|reasoning_thinking_end|>", "<|reserved_special_token_903|>")]
    for ids in [emoji[:1], emoji[1:], emoji[::-1], specials + emoji, [0, 255, 199_999, 202_047]]:
        assert tok.decode(ids) == meta.decode(ids), ids
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([202_048])


def test_token_bytes_spell_the_text_and_mark_the_specials(tok, meta):
    pieces = tok.token_bytes()
    assert len(pieces) == tok.n_words
    text = "Zürich 🦙 camelCase\n\n  12345"
    assert b"".join(pieces[i] for i in meta.encode(text, bos=False, eos=False)) == text.encode()
    for name, i in meta.special_tokens.items():
        assert pieces[i] == b"\xff" + name.encode()


def _tiny_tiktoken(folder: Path, params: object = None) -> Path:
    """A tokenizer.model of the 256 byte tokens, with a params.json beside it when given."""
    folder.mkdir()
    path = folder / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    if params is not None:
        (folder / "params.json").write_text(params if isinstance(params, str) else json.dumps(params))
    return path


@pytest.mark.parametrize("params, family", [
    (None, "llama3"),
    ({"dim": 64, "vocab_size": 2304}, "llama3"),
    ({"dim": 64, "moe_args": {"num_experts": 4}}, "llama4"),
    ({"model": {"dim": 64, "moe_args": {"num_experts": 4}}}, "llama4"),
    ("{not json", "llama3"),
])
def test_family_of_a_small_tokenizer_comes_from_params_json(tmp_path, params, family):
    tok = load_tokenizer(_tiny_tiktoken(tmp_path / "ckpt", params))
    assert tok.family == family
    assert tok.n_words == 256 + (2048 if family == "llama4" else 256)
    if family == "llama4":
        assert tok.bos_id == 256 and tok.decode([256 + 8]) == "<|eot|>"


def test_metas_file_is_llama4_by_its_ranks_alone(tmp_path, model_path):
    """Meta's 200,000-rank file is Llama 4's wherever it lies, beside a Llama 3 params.json too."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "tokenizer.model").symlink_to(model_path)
    (folder / "params.json").write_text(json.dumps({"dim": 64, "vocab_size": 128_256}))
    assert load_tokenizer(folder / "tokenizer.model").family == "llama4"
    assert not is_llama4_params({"dim": 64, "model": "moe_args"}) and not is_llama4_params([])


# ---------------------------------------------------------------------------------------------
# Dialogs


def meta_ids(chat_format, messages: list) -> list[int]:
    """Meta's ChatFormat on {"role", "content"} dicts and ready RawMessages, calls written as Python lists."""
    from llama_models.datatypes import RawMessage, ToolPromptFormat

    raw = [m if isinstance(m, RawMessage) else RawMessage(role=m["role"], content=m["content"]) for m in messages]
    return list(chat_format.encode_dialog_prompt(raw, ToolPromptFormat.python_list).tokens)


DIALOGS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are a helpful assistant"},
     {"role": "user", "content": "Answer who are you in the form of jeopardy?"}],
    [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "\n\nWhat is 2+2?  "},
     {"role": "assistant", "content": " 4 \n"}, {"role": "user", "content": "And 日本 × 🦙?"}],
    [{"role": "user", "content": "Say <|eot|> and <|header_start|>assistant<|header_end|>"},
     {"role": "assistant", "content": "<|eot|>"}, {"role": "user", "content": ""}],
]


@pytest.mark.parametrize("dialog", DIALOGS, ids=[f"dialog{i}" for i in range(len(DIALOGS))])
def test_chat_template_matches_meta_chat_format(tok, chat_format, dialog):
    assert tok.encode_chat(dialog) == meta_ids(chat_format, dialog)


def test_text_parts_encode_apart_like_meta_chat_format(tok, chat_format):
    """OpenAI text parts are Meta's RawTextItems, each encoded on its own and as sent, with tools or without."""
    from llama_models.datatypes import RawMessage, RawTextItem

    from tp_llama.serving.openai_api import chat_messages

    turns = [("system", [" Be ", "brief\n"]), ("user", ["Hel", "lo world", "", "<|eot|>"]), ("assistant", ["I'", "m"]),
             ("user", ["日", "本 🦙"])]
    messages = [{"role": r, "content": [{"type": "text", "text": t} for t in texts]} for r, texts in turns]
    raw = [RawMessage(role=r, content=[RawTextItem(text=t) for t in texts]) for r, texts in turns]
    assert tok.encode_chat(chat_messages(messages)) == meta_ids(chat_format, raw)
    system, question = guide_turns()
    ours = encode_tool_chat(tok, chat_messages(messages[1:]), [WEATHER], FMT)
    assert ours == meta_ids(chat_format, [system, *raw[1:]])


# ---------------------------------------------------------------------------------------------
# Tool calling

# The input prompt of "Zero shot function calling - system message" in Meta's Llama 4 prompt format,
# https://www.llama.com/docs/model-cards-and-prompt-formats/llama4/ (llama-models'
# models/llama4/prompt_format.md), as the page prints it.
GUIDE_PROMPT = """<|begin_of_text|><|header_start|>system<|header_end|>

You are a helpful assistant and an expert in function composition. You can answer general questions using your internal knowledge OR invoke functions when necessary. Follow these strict guidelines:

1. FUNCTION CALLS:
- ONLY use functions that are EXPLICITLY listed in the function list below
- If NO functions are listed (empty function list []), respond ONLY with internal knowledge or "I don't have access to [Unavailable service] information"
- If a function is not in the list, respond ONLY with internal knowledge or "I don't have access to [Unavailable service] information"
- If ALL required parameters are present AND the query EXACTLY matches a listed function's purpose: output ONLY the function call(s)
- Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]
Examples:
CORRECT: [get_weather(location="Vancouver"), calculate_route(start="Boston", end="New York")] <- Only if get_weather and calculate_route are in function list
INCORRECT: get_weather(location="New York")
INCORRECT: Let me check the weather: [get_weather(location="New York")]
INCORRECT: [get_events(location="Singapore")] <- If function not in list

2. RESPONSE RULES:
- For pure function requests matching a listed function: ONLY output the function call(s)
- For knowledge questions: ONLY output text
- For missing parameters: ONLY request the specific missing parameters
- For unavailable services (not in function list): output ONLY with internal knowledge or "I don't have access to [Unavailable service] information". Do NOT execute a function call.
- If the query asks for information beyond what a listed function provides: output ONLY with internal knowledge about your limitations
- NEVER combine text and function calls in the same response
- NEVER suggest alternative functions when the requested service is unavailable
- NEVER create or invent new functions not listed below

3. STRICT BOUNDARIES:
- ONLY use functions from the list below - no exceptions
- NEVER use a function as an alternative to unavailable information
- NEVER call functions not present in the function list
- NEVER add explanatory text to function calls
- NEVER respond with empty brackets
- Use proper Python/JSON syntax for function calls
- Check the function list carefully before responding

4. TOOL RESPONSE HANDLING:
- When receiving tool responses: provide concise, natural language responses
- Don't repeat tool response verbatim
- Don't add supplementary information

Here is a list of functions in JSON format that you can invoke:
[
    {
        "name": "get_weather",
        "description": "Get weather info for places",
        "parameters": {
            "type": "dict",
            "required": ["city"],
            "properties": {
                "city": {
                    "type": "string",
                    "description": "The name of the city to get the weather for"
                },
                "metric": {
                    "type": "string",
                    "description": "The metric for weather. Options are: celsius, fahrenheit",
                    "default": "celsius"
                }
            }
        }
    }
]<|eot|><|header_start|>user<|header_end|>

What is the weather in SF and Seattle?<|eot|><|header_start|>assistant<|header_end|>

"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get weather info for places",
                                            "parameters": {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "description": "The name of the city to get the weather for"},
    "metric": {"type": "string", "description": "The metric for weather. Options are: celsius, fahrenheit",
               "default": "celsius"}}}}}
CLOCK = {"type": "function", "function": {"name": "f", "description": "", "parameters": {
    "type": "object", "required": ["a"], "additionalProperties": False,
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
SHORT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 8}, "metric": {"enum": ["celsius", "fahrenheit"]}}}}}


def guide_turns() -> list[dict]:
    turns = re.findall(r"<\|header_start\|>(\w+)<\|header_end\|>\n\n(.*?)<\|eot\|>", GUIDE_PROMPT, re.S)
    assert [role for role, _ in turns] == ["system", "user"]
    return [{"role": role, "content": content} for role, content in turns]


def test_tools_prompt_matches_the_llama4_guide(tok, meta, chat_format):
    system, question = guide_turns()
    ours = encode_tool_chat(tok, [question], [WEATHER], FMT)
    assert ours == meta_ids(chat_format, [system, question])
    assert tok.decode(ours) == GUIDE_PROMPT


def test_history_with_a_call_and_its_result_matches_meta_chat_format(tok, chat_format):
    from llama_models.datatypes import RawMessage, StopReason, ToolCall

    system, question = guide_turns()
    arguments = {"city": "San Francisco", "metric": "celsius", "days": [1, 2], "hourly": True, "n": None}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    openai = [question, {"role": "assistant", "content": None, "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "call_1", "content": '"25 C"'},
              {"role": "assistant", "content": "It is 25 C in San Francisco."},
              {"role": "user", "content": "And tomorrow?"}]
    raw = [system, question,
           RawMessage(role="assistant", content="", stop_reason=StopReason.end_of_turn,
                      tool_calls=[ToolCall(call_id="call_1", tool_name="get_weather", arguments=arguments)]),
           RawMessage(role="tool", content='"25 C"'),
           RawMessage(role="assistant", content="It is 25 C in San Francisco.", stop_reason=StopReason.end_of_turn),
           RawMessage(role="user", content="And tomorrow?")]
    ours = encode_tool_chat(tok, openai, [WEATHER], FMT)
    assert ours == meta_ids(chat_format, raw)
    text = tok.decode(ours)
    assert ('<|header_start|>assistant<|header_end|>\n\n[get_weather(city="San Francisco", metric="celsius", '
            'days=[1, 2], hourly=True, n=None)]<|eom|><|header_start|>ipython<|header_end|>\n\n"25 C"<|eom|>') in text


def test_parallel_calls_system_message_and_choice(tok):
    """Several calls go back as the one list the model writes; a caller's system message and a forced
    choice follow the tool list in the system prompt."""
    calls = [{"id": str(i), "type": "function", "function": {"name": n, "arguments": a}}
             for i, (n, a) in enumerate([("get_weather", '{"city": "Oslo"}'), ("f", '{"a": 3}')])]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": calls}]
    text = tok.decode(encode_tool_chat(tok, chat, [WEATHER, CLOCK], FMT, tool_choice="required"))
    assert '<|header_end|>\n\n[get_weather(city="Oslo"), f(a=3)]<|eom|>' in text
    assert text.split("<|eot|>")[0].endswith(
        "]\nBe brief.\nYou MUST use one of the provided functions/tools to answer the user query.")


def test_the_format_is_chosen_from_the_checkpoint_and_must_fit_it(tok, model_path):
    assert resolve_tool_format("auto", "llama4", dim=5120) == FMT
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER]}
    ids, use = chat_ids(body, body["messages"], tok, "auto")
    assert use.fmt == FMT and use.parallel
    assert ids == encode_tool_chat(tok, body["messages"], [WEATHER], FMT)
    for fmt in ("pythonic", "llama3_json"):
        with pytest.raises(RequestError, match="does not fit this llama4 checkpoint"):
            tool_use(body, fmt, "llama4")
        with pytest.raises(ValueError, match="is not a llama4 format"):
            encode_tool_chat(tok, body["messages"], [WEATHER], fmt)
    with pytest.raises(RequestError, match="does not fit this llama3 checkpoint"):
        tool_use(body, FMT, "llama3")
    llama3 = load_tokenizer(Path(str(importlib.resources.files("llama_models.llama3") / "tokenizer.model")))
    with pytest.raises(ValueError, match="is not a llama3 format"):
        encode_tool_chat(llama3, body["messages"], [WEATHER], FMT)


def test_replies_parse_as_metas_decoder_reads_them(chat_format):
    """Meta's python_list encoding of a call, in the wrappings a Llama 4 reply may carry, parses to the
    call, and to what Meta's own decoder reads from the same reply."""
    from llama_models.datatypes import StopReason, ToolCall, ToolPromptFormat
    from llama_models.llama3.tool_utils import ToolUtils

    for arguments in [{"city": "Paris"}, {"city": "São Paulo", "metric": "celsius", "n": -3, "x": 2.5,
                                          "ok": False, "none": None, "days": [1, 2.5, "b"]}, {}]:
        call = ToolCall(call_id="1", tool_name="get_weather", arguments=arguments)
        text = ToolUtils.encode_tool_call(call, ToolPromptFormat.python_list)
        for reply in (text, f"{text}<|eot|>", f" {text}\n<|eom|>", f"<|python_start|>{text}<|python_end|><|eot|>"):
            assert parse_tool_calls(reply, FMT, [WEATHER]) == [{"name": "get_weather", "arguments": arguments}]
            decoded = chat_format.decode_assistant_message_from_content(reply, StopReason.end_of_turn)
            assert [(c.tool_name, c.arguments) for c in decoded.tool_calls] == [("get_weather", arguments)]


def test_a_parallel_reply_parses_to_every_call():
    reply = '[get_weather(city="Paris"), f(a=1)]<|eot|>'
    assert parse_tool_calls(reply, FMT, [WEATHER, CLOCK]) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {"a": 1}}]


@pytest.mark.parametrize("reply", [
    "The weather in Paris is fine.<|eot|>",
    '[get_weather(city="Paris")',
    '[get_weather(city="Paris")]] <|eot|>',
    '<|python_tag|>[get_weather(city="Paris")]',
    'Let me check the weather: [get_weather(city="Paris")]<|eot|>',
    "[get_weather(city=open('/etc/passwd').read())]",
    "[get_events(location='Singapore')]<|eot|>",
    "[]<|eot|>",
    '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot|>',
])
def test_malformed_replies_come_back_as_content(reply):
    assert parse_tool_calls(reply, FMT, [WEATHER]) is None
    content, calls, is_call = ToolReply(ToolUse([WEATHER], "auto", FMT, True)).finish(reply)
    assert (content, calls, is_call) == (reply, [], False)


def test_grammar_walks_over_the_llama4_vocabulary_are_calls(tok):
    """Random walks of llguidance's masks over the real vocabulary, for a forced parallel call: each ends
    as calls that parse; the grammar names no token the Llama 4 vocabulary lacks."""
    grammar = tool_call_grammar([SHORT_WEATHER, CLOCK], "required", FMT, True)
    assert "python_tag" not in grammar and LLMatcher.validate_grammar(grammar) == ""
    eot = tok.special_ids["<|eot|>"]
    ll = lltokenizer_from_encoding(tok._enc, eos_token=eot)
    rng = random.Random(5)
    for _ in range(3):
        matcher, ids = LLMatcher(ll, grammar), []
        while not (matcher.is_accepting() and rng.random() < 0.3):
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                                                   bitorder="little"))
            allowed = allowed[(allowed != eot) & (allowed < tok.n_words)]
            if not len(allowed):
                break
            ids.append(int(rng.choice(allowed)))
            assert matcher.consume_token(ids[-1]), matcher.get_error()
            assert len(ids) < 300, tok.decode(ids)
        assert matcher.is_accepting()
        calls = parse_tool_calls(tok.decode(ids) + "<|eot|>", FMT, [SHORT_WEATHER, CLOCK])
        assert calls and {c["name"] for c in calls} <= {"get_weather", "f"}, tok.decode(ids)
        for call in calls:
            jsonschema.validate(call["arguments"], (SHORT_WEATHER if call["name"] == "get_weather" else CLOCK)
                                ["function"]["parameters"])
