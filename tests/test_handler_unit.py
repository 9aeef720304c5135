"""The handler's request validation, settings and streaming, without TorchServe or a model.

The end-to-end test covers the real server; these pin down each rule quickly and drive the
continuous-batching handler call by call, as TorchServe does, over a real one-process engine.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
import weakref
from pathlib import Path

import pytest
import torch


import handler.llama_handler as llama_handler
from tp_llama.serving.native import parse_request
from tp_llama.serving.request import Job, RequestError, decode_body
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.speculate import Speculator
from tp_llama.serving.settings import HandlerSettings, resolve_ckpt_dir, settings_from_yaml
from tp_llama.serving.stream import StreamDecoder

from tests.support.hostile_corpus import hostile_corpus

from tp_llama.tokenizer import load_tokenizer
from tp_llama.testing.tokenizer_train import build_tokenizer

SETTINGS = HandlerSettings(EngineConfig("/ckpt", max_seq_len=64), default_max_new_tokens=16, max_new_tokens_limit=32,
                           temperature=0.6, top_p=0.9, max_request_bytes=512)
WITHIN_CALLS = dataclasses.replace(SETTINGS, step_between_calls=False)  # what a test sees between calls stays put


class ByteTokenizer:
    """One id per UTF-8 byte plus BOS=1000; chat joins the contents."""

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return ([1000] if bos else []) + list(text.encode("utf-8"))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if messages[-1]["role"] != "user":
            raise ValueError("the last message must be from the user")
        return self.encode(" ".join("".join(m["content"]) for m in messages))  # content: a str or text parts

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def parse(body: bytes | dict | str):
    return parse_request({"body": body}, SETTINGS, ByteTokenizer(), 1001)


def test_defaults_come_from_the_yaml_settings() -> None:
    job = parse(b'{"prompt": "hi"}')
    assert job.prompt_ids == [1000, 104, 105]
    assert (job.params.max_new_tokens, job.params.temperature, job.params.top_p, job.params.seed, job.params.ignore_eos, job.stream) == (
        16, 0.6, 0.9, None, False, False)


def test_the_sampling_fields_reach_the_params() -> None:
    params = parse(b'{"prompt": "hi", "top_k": 40, "min_p": 0.05, "frequency_penalty": 0.5, "presence_penalty": -1, '
                   b'"repetition_penalty": 1.2, "logit_bias": {"7": -100, "9": 2.5}, "logprobs": 3}').params
    assert (params.top_k, params.min_p, params.frequency_penalty, params.presence_penalty, params.repetition_penalty,
            params.logit_bias, params.logprobs) == (40, 0.05, 0.5, -1.0, 1.2, ((7, -100.0), (9, 2.5)), 3)
    assert parse(b'{"prompt": "hi", "top_k": -1}').params.top_k == 0  # vLLM's "no limit"
    defaults = parse(b'{"prompt": "hi"}').params
    assert (defaults.top_k, defaults.min_p, defaults.repetition_penalty, defaults.logit_bias, defaults.logprobs) == (
        0, 0.0, 1.0, (), None)


def test_logit_bias_keys_naming_one_token_give_it_one_bias_in_range() -> None:
    """OpenAI's values lie in [-100, 100]: "5" and "05" name token 5 once, the last bias kept (vLLM's int(key) dict),
    never summed to 200 past the documented range."""
    params = parse(b'{"prompt": "hi", "logit_bias": {"5": 100, "7": 1, "05": 100, "005": -3}}').params
    assert dict(params.logit_bias) == {5: -3.0, 7: 1.0} and len(params.logit_bias) == 2


def test_all_fields_and_nulls() -> None:
    job = parse(b'{"prompt": "hi", "max_new_tokens": 5, "temperature": 0, "top_p": 1, "seed": 7, '
                b'"ignore_eos": true, "stream": true}')
    assert (job.params.max_new_tokens, job.params.temperature, job.params.top_p, job.params.seed, job.params.ignore_eos, job.stream) == (
        5, 0.0, 1.0, 7, True, True)
    job = parse(b'{"prompt": "hi", "max_new_tokens": null, "seed": null, "stream": null}')
    assert (job.params.max_new_tokens, job.params.seed, job.stream) == (16, None, False)


def test_default_max_new_tokens_shrinks_to_fit_but_explicit_values_must_fit() -> None:
    prompt = "x" * 55  # 56 tokens with BOS, 8 left of max_seq_len 64
    assert parse(json.dumps({"prompt": prompt})).params.max_new_tokens == 8
    with pytest.raises(RequestError, match="exceeds max_seq_len 64"):
        parse(json.dumps({"prompt": prompt, "max_new_tokens": 9}))
    with pytest.raises(RequestError, match="leaves no room"):
        parse(json.dumps({"prompt": "x" * 63}))


@pytest.mark.parametrize(
    "body, message",
    [
        (b"", "not valid JSON"),
        (b"{'prompt': 'hi'}", "not valid JSON"),
        (b'{"prompt": "caf\xe9"}', "not valid UTF-8"),
        (b'"hi"', "must be a JSON object, got string"),
        (b'{"prompt": "hi", "prompt": "ho"}', "duplicate field 'prompt'"),
        (b'{"prompt": "hi", "temperature": Infinity}', "not valid JSON"),
        (b'{"prompt": "hi", "extra": 1}', "unknown field(s) ['extra']"),
        (b'{"prompt": "hi", "max_new_tokens": 1.0}', "max_new_tokens must be an integer, got number"),
        (b'{"prompt": "hi", "max_new_tokens": false}', "max_new_tokens must be an integer, got boolean"),
        (b'{"prompt": "hi", "max_new_tokens": 33}', "exceeds the limit 32"),
        (b'{"prompt": "hi", "max_new_tokens": -3}', "must be >= 1"),
        (b'{"prompt": "hi", "temperature": "0.5"}', "temperature must be a number, got string"),
        (b'{"prompt": "hi", "temperature": true}', "temperature must be a number, got boolean"),
        (b'{"prompt": "hi", "temperature": 1e999}', "temperature must be finite"),
        (b'{"prompt": "hi", "top_p": -0.1}', "top_p must be in (0, 1]"),
        (b'{"prompt": "hi", "seed": 9223372036854775808}', "seed must be in [0, 2**63)"),
        (b'{"prompt": "hi", "seed": 1.5}', "seed must be an integer"),
        (b'{"prompt": "hi", "stream": 1}', "stream must be true or false, got integer"),
        (b'{"prompt": "hi", "top_k": -2}', "top_k must be -1 or 0 (no limit) or a positive integer"),
        (b'{"prompt": "hi", "top_k": 2.5}', "top_k must be an integer"),
        (b'{"prompt": "hi", "min_p": 1.5}', "min_p must be in [0, 1]"),
        (b'{"prompt": "hi", "frequency_penalty": 2.5}', "frequency_penalty must be in [-2, 2]"),
        (b'{"prompt": "hi", "presence_penalty": -3}', "presence_penalty must be in [-2, 2]"),
        (b'{"prompt": "hi", "repetition_penalty": 0}', "repetition_penalty must be in (0, 2]"),
        (b'{"prompt": "hi", "logit_bias": [1]}', "logit_bias must be an object"),
        (b'{"prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias keys must be token ids in [0, 1001)"),
        (b'{"prompt": "hi", "logit_bias": {"1001": 1}}', "logit_bias keys must be token ids in [0, 1001)"),
        (b'{"prompt": "hi", "logit_bias": {"5": 101}}', "logit_bias values must be numbers in [-100, 100]"),
        (b'{"prompt": "hi", "logit_bias": {"5": true}}', "logit_bias values must be numbers in [-100, 100]"),
        (b'{"prompt": "hi", "logprobs": 21}', "logprobs must be in [0, 20]"),
        (b'{"prompt": "hi", "logprobs": true}', "logprobs must be an integer"),
        (b'{"prompt": null}', "prompt must be a string, got null"),
        (b'{"prompt": ""}', "prompt must not be empty"),
        (b"{}", "exactly one of"),
        (b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "exactly one of"),
        (b'{"messages": {"role": "user"}}', "non-empty array"),
        (b'{"messages": ["hi"]}', "messages[0] must be an object, got string"),
        (b'{"messages": [{"role": "user", "content": "b", "x": 1}]}', "unknown field(s) ['x']"),
        (b'{"messages": [{"role": "assistant", "content": "b"}]}', "invalid messages: the last message"),
        (b'{"prompt": "' + b"y" * 600 + b'"}', "the limit is 512"),
        (b'{"prompt": "a\\ud800b"}', "unpaired UTF-16 surrogate"),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "unpaired UTF-16 surrogate"),
    ],
)
def test_invalid_requests_name_the_problem(body: bytes, message: str) -> None:
    with pytest.raises(RequestError) as info:
        parse(body)
    assert message in str(info.value)


def test_deep_nesting_is_a_bad_request() -> None:
    with pytest.raises(RequestError, match="nested too deeply"):
        decode_body(b"[" * 100_000 + b"]" * 100_000, 1_000_000)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(RequestError, match="nested too deeply"):
        decode_body({"prompt": deep}, 1_000_000)


def test_a_number_longer_than_int_reads_is_a_bad_request() -> None:
    """json.loads raises a bare ValueError past int()'s digit limit, which the handler answered as its own 500."""
    with pytest.raises(RequestError, match="a number too long to read"):
        decode_body(b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", 1_000_000)
    with pytest.raises(RequestError, match="duplicate field"):  # the parser's own refusals pass through as they are
        decode_body(b'{"seed": 1, "seed": 2}', 1_000_000)


def test_bodies_torchserve_already_decoded() -> None:
    assert parse({"prompt": "hi"}).prompt_ids == [1000, 104, 105]
    assert parse('{"prompt": "hi"}').prompt_ids == [1000, 104, 105]
    with pytest.raises(RequestError, match="temperature must be finite"):
        parse({"prompt": "hi", "temperature": float("nan")})
    with pytest.raises(RequestError, match="must be a JSON object, got array"):
        parse([1, 2])
    with pytest.raises(RequestError, match="Content-Type: application/json"):
        parse_request({"prompt": "hi"}, SETTINGS, ByteTokenizer(), 1001)


def test_settings_reject_typos_and_bad_values(tmp_path: Path) -> None:
    assert settings_from_yaml({"ckpt_dir": "c"}) == HandlerSettings(EngineConfig("c"))
    assert settings_from_yaml({"ckpt_dir": "c", "quantize": "int4"}).engine.quantize == "int4"
    for block, message in [
        ({}, "ckpt_dir"),
        ({"ckpt_dir": "c", "max_seqlen": 5}, "unknown key"),
        ({"ckpt_dir": "c", "mode": "pp"}, "handler.mode"),
        ({"ckpt_dir": "c", "max_seq_len": "2048"}, "handler.max_seq_len"),
        ({"ckpt_dir": "c", "max_batch_size": True}, "handler.max_batch_size"),
        ({"ckpt_dir": "c", "top_p": 0}, "handler.top_p"),
        ({"ckpt_dir": "c", "temperature": -1}, "handler.temperature"),
        ({"ckpt_dir": "c", "default_max_new_tokens": 50, "max_new_tokens_limit": 10}, "must not exceed"),
        ({"ckpt_dir": "c", "kv_block_size": 24}, "handler.kv_block_size must be a multiple of 16"),
        ({"ckpt_dir": "c", "kv_block_size": 8}, "handler.kv_block_size must be an integer >= 16"),
        ({"ckpt_dir": "c", "kv_cache_memory_gb": -1}, "handler.kv_cache_memory_gb"),
        ({"ckpt_dir": "c", "prefix_caching": "yes"}, "handler.prefix_caching must be true or false"),
        ({"ckpt_dir": "c", "quantize": "int3"}, "handler.quantize"),
        ({"ckpt_dir": "c", "quantize": "int8", "mode": "fsdp"}, "needs mode 'tp'"),
    ]:
        with pytest.raises(ValueError, match=message):
            settings_from_yaml(block)


def test_relative_ckpt_dir_is_taken_from_the_real_model_folder(tmp_path: Path) -> None:
    store = tmp_path / "model_store" / "llama"
    store.mkdir(parents=True)
    ckpt = tmp_path / "checkpoints" / "x"
    ckpt.mkdir(parents=True)
    link = tmp_path / "tmp-models" / "llama"
    link.parent.mkdir()
    link.symlink_to(store)
    assert resolve_ckpt_dir("../../checkpoints/x", str(link)) == str(ckpt)
    assert resolve_ckpt_dir(str(ckpt), "/nowhere") == str(ckpt)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_ckpt_dir("missing", str(link))


@pytest.fixture(scope="module", params=["llama2", "llama3"])
def real_tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.model"
    build_tokenizer(request.param, path, 512)
    return load_tokenizer(path)


def test_stream_pieces_never_split_a_character(real_tokenizer) -> None:
    text = "Grüße aus Köln, 東京 and 🎉 naïve café — ok"
    ids = real_tokenizer.encode(text, bos=False)
    stream = StreamDecoder(real_tokenizer.decode)
    pieces = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(pieces) == real_tokenizer.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)


def test_long_stream_pieces_add_up_and_each_push_decodes_a_short_window(real_tokenizer) -> None:
    """Pieces of a long reply (paragraphs, spaces and newlines at every kind of boundary, multi-byte
    characters) add up to the reply decoded whole, and a push decodes a window of a few ids, not the reply
    so far (a step's cost must not grow with the replies' lengths)."""
    text = "\n\n".join(f"Paragraph {i}: Grüße aus Köln,  東京 — naïve café 🎉 ok.\n  - item {i * 7}" for i in range(60))
    ids = real_tokenizer.encode(text, bos=False)
    widest = [0]

    def decode(window: list[int]) -> str:
        widest[0] = max(widest[0], len(window))
        return real_tokenizer.decode(window)

    stream = StreamDecoder(decode)
    pieces = [stream.push([i]) for i in ids]
    assert len(ids) > 1000 and widest[0] <= 16
    pieces.append(stream.finish())
    assert "".join(pieces) == real_tokenizer.decode(ids) == text


def test_the_stream_decode_benchmark_prints_its_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from bench.serving import stream_decode

    build_tokenizer("llama3", tmp_path / "tokenizer.model", 512)
    stream_decode.main(["--tokenizer", str(tmp_path / "tokenizer.model"), "--lengths", "16", "80", "--rows", "2"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(table) == 3 and table[1].startswith("| 16 |") and table[2].startswith("| 80 |")


def test_stream_pieces_add_up_even_with_invalid_bytes() -> None:
    tokenizer = ByteTokenizer()
    ids = list("a€b".encode()) + [0xE2, 0x82] + list(b"c") + [0xF0]
    stream = StreamDecoder(tokenizer.decode)
    pieces = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert pieces[:3] == ["a", "", ""] and pieces[3] == "€"


def test_a_push_of_no_ids_decodes_nothing_and_changes_no_piece() -> None:
    """The native API pushes every unfinished choice on every call, mostly with no new ids: such a push must not
    decode (it did, twice), and the pieces, partial characters held back included, stay what they were."""
    tokenizer, calls = ByteTokenizer(), [0]

    def decode(ids: list[int]) -> str:
        calls[0] += 1
        return tokenizer.decode(ids)

    ids = list("a€b".encode()) + [0xE2, 0x82] + list(b"c") + [0xF0]
    plain = StreamDecoder(tokenizer.decode)
    want = [plain.push([i]) for i in ids] + [plain.finish()]
    stream = StreamDecoder(decode)
    got = [stream.push([])]
    assert calls[0] == 0
    for i in ids:
        before = calls[0]
        got += [stream.push([i]), stream.push([]), stream.push([])]
        assert calls[0] - before == 2  # the push of the new id; none for the two empty ones
    got.append(stream.finish())
    assert "".join(got) == "".join(want) == tokenizer.decode(ids)
    assert [piece for piece in got if piece] == [piece for piece in want if piece]


class FakeContext:
    """TorchServe's side of a call: request ids in, per-request status, type and headers out."""

    def __init__(self, ids: list[str], paths: dict[str, str] | None = None) -> None:
        self.request_ids = dict(enumerate(ids))
        self.url_paths = [(paths or {}).get(rid, "") for rid in ids]
        self.status: dict[int, int] = {}
        self.content_types: dict[int, str] = {}
        self.headers: dict[int, dict[str, str]] = {}
        self.stopping_criteria = None
        self.metrics = None

    def set_response_status(self, code: int, phrase: str, idx: int) -> None:
        self.status[idx] = code

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.content_types[idx] = value

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.headers.setdefault(idx, {})[key] = value

    def get_request_header(self, idx: int, key: str) -> str | None:
        return self.url_paths[idx] if key == "url_path" else None


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, device: str):
    """A real one-process engine on a tiny synthetic Llama 3 checkpoint, on the tests' device (`--device`)."""
    from tp_llama.engine.core import Engine
    from tp_llama.testing.synthetic import write_checkpoint

    ckpt = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(ckpt, "llama3", 1, 64, 2, 4, 2, 512, 32, None, torch.float32, 0)
    return Engine.load(EngineConfig(str(ckpt), "tp", "float32", max_seq_len=64, max_batch_size=3, prefill_budget=8,
                                    device=device))


ON_ENGINE: dict[int, weakref.WeakSet] = collections.defaultdict(weakref.WeakSet)  # the handlers made on each engine


class SharedEngineHandler(llama_handler.LlamaHandler):
    """A worker has one handler on its engine; tests make several on one engine, each with its own
    scheduler over the same KV cache. A handler left with requests in progress goes on stepping between
    calls, so before a call the other handlers on the engine end theirs: two step threads must never
    run the engine at once (a test's reply then depended on the previous test's steps' timing)."""

    def handle(self, data: list[dict], context) -> list[str]:
        for other in ON_ENGINE[id(self.engine)]:
            if other is not self:
                other.steps.end_between_calls()
        return super().handle(data, context)


def new_handler(engine, settings: HandlerSettings = SETTINGS, grammars=None) -> llama_handler.LlamaHandler:
    """A rank-0 handler over `engine`, as initialize() leaves it (`grammars`: its GrammarCompiler)."""
    handler = SharedEngineHandler()
    handler.engine, handler.settings, handler.grammars = engine, settings, grammars
    handler.scheduler = engine.new_scheduler()
    handler.steps = llama_handler.StepThread()
    ON_ENGINE[id(engine)].add(handler)
    return handler


def serve(handler, calls: list[list[tuple[str, bytes | None]]],
          paths: dict[str, str] | None = None) -> dict[str, list[tuple[str, FakeContext, int]]]:
    """Run calls as TorchServe would (a request in progress comes back without its body); replies by id.
    `paths`: the url_path header of a request id (OpenAI paths), "" when absent."""
    replies: dict[str, list] = {}
    for call in calls:
        context = FakeContext([rid for rid, _ in call], paths)
        data = [{} if body is None else {"body": body} for _, body in call]
        for idx, reply in enumerate(handler.handle(data, context)):
            # What TorchServe's encoder does with the handler's stopping criteria.
            stop = context.stopping_criteria[idx](reply)
            if stop is not None:
                context.set_response_header(idx, "ts_stream_next", "false" if stop else "true")
            replies.setdefault(call[idx][0], []).append((reply, context, idx))
    return replies


def run_to_end(handler, requests: dict[str, bytes], max_calls: int = 200,
               paths: dict[str, str] | None = None) -> dict[str, list]:
    """Call until every request has had its last reply (ts_stream_next false or no header)."""
    pending, replies, first = dict(requests), {}, True
    for _ in range(max_calls):
        if not pending:
            return replies
        call = [(rid, body if first else None) for rid, body in pending.items()]
        first = False
        for rid, got in serve(handler, [call], paths).items():
            replies.setdefault(rid, []).extend(got)
            _, context, idx = got[-1]
            if context.headers.get(idx, {}).get("ts_stream_next") != "true":
                del pending[rid]
    raise AssertionError(f"requests never finished: {sorted(pending)}")


def final_json(replies: list) -> dict:
    return json.loads(replies[-1][0])


GREEDY = b'{"prompt": "%s", "max_new_tokens": %d, "temperature": 0, "ignore_eos": true%s}'


def test_a_call_mixing_good_and_bad_requests(engine) -> None:
    handler = new_handler(engine)
    alone = {}
    for rid, body in (("a", GREEDY % (b"hello there", 5, b"")), ("c", GREEDY % (b"once upon", 4, b""))):
        alone[rid] = final_json(run_to_end(new_handler(engine), {rid: body})[rid])  # c alone, not streamed
    replies = run_to_end(handler, {"a": GREEDY % (b"hello there", 5, b""), "b": b'{"prompt": 5}',
                                   "c": GREEDY % (b"once upon", 4, b', "stream": true')})
    _, context, idx = replies["b"][0]
    assert len(replies["b"]) == 1 and context.status[idx] == 400 and "ts_stream_next" not in context.headers.get(idx, {})
    assert final_json(replies["b"]) == {"error": "prompt must be a string, got integer"}
    assert final_json(replies["a"]) == alone["a"] and len(alone["a"]["token_ids"]) == 5
    assert all(reply == "" for reply, _, _ in replies["a"][:-1])  # nothing before the whole answer
    lines = [json.loads(reply) for reply, _, _ in replies["c"] if reply]
    assert [t for line in lines for t in line["token_ids"]] == alone["c"]["token_ids"]
    assert "".join(line["text"] for line in lines) == engine.tokenizer.decode(alone["c"]["token_ids"])
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["usage"]["completion_tokens"] == 4
    _, context, idx = replies["c"][-1]
    assert context.content_types[idx] == "application/x-ndjson" and context.headers[idx]["ts_stream_next"] == "false"
    assert (len(handler.scheduler.running), handler.scheduler.pool.used) == (0, 0) and not handler.live


def test_a_request_joins_a_running_batch_and_answers_as_if_alone(engine) -> None:
    long, short = GREEDY % (b"a long story about", 30, b""), GREEDY % (b"short", 3, b"")
    want = final_json(run_to_end(new_handler(engine), {"s": short})["s"])
    handler = new_handler(engine)
    serve(handler, [[("l", long)], [("l", None)], [("l", None)]])
    replies = run_to_end(handler, {"s": short})  # "l" is absent from these calls: it is cancelled
    assert final_json(replies["s"]) == want
    assert len(replies["s"]) <= 4  # prefill + 3 tokens, not behind the long one


def tokens_per_reply(replies: list) -> list[int]:
    return [sum(len(json.loads(line)["token_ids"]) for line in reply.splitlines()) for reply, _, _ in replies]


def test_decode_only_calls_run_steps_within_their_time_and_end_when_a_sequence_finishes(engine) -> None:
    body = GREEDY % (b"hi", 9, b', "stream": true')
    one_step = new_handler(engine, dataclasses.replace(SETTINGS, decode_call_ms=0, step_between_calls=False))
    assert tokens_per_reply(run_to_end(one_step, {"s": body})["s"]) == [1] * 9
    unbounded = new_handler(engine, dataclasses.replace(SETTINGS, decode_call_ms=10**6, step_between_calls=False))
    # the prefill call samples the first token; one call decodes the rest and stops when it is done
    replies = run_to_end(unbounded, {"s": body, "t": GREEDY % (b"hey", 4, b', "stream": true')})
    assert tokens_per_reply(replies["t"]) == [1, 3] and tokens_per_reply(replies["s"]) == [1, 3, 5]


def test_steps_go_on_between_calls_and_the_next_call_sends_their_tokens(engine) -> None:
    body = GREEDY % (b"hi", 9, b', "stream": true')
    within = run_to_end(new_handler(engine, WITHIN_CALLS), {"s": body})["s"]
    handler = new_handler(engine, dataclasses.replace(SETTINGS, decode_call_ms=0))
    first = serve(handler, [[("s", body)]])["s"]  # the prompt's step: one token
    handler.steps.submit(lambda: None).result(timeout=30)  # no call comes: the steps go on to the sequence's end
    assert handler.scheduler.snapshot().decoding == 0 and not handler.scheduler.has_work()
    rest = serve(handler, [[("s", None)]])["s"]  # one call answers the 8 tokens made meanwhile, and ends
    assert tokens_per_reply(first + rest) == [1, 8] and rest[0][1].headers[0]["ts_stream_next"] == "false"
    tokens = [t for reply, _, _ in first + rest for line in reply.splitlines() for t in json.loads(line)["token_ids"]]
    assert tokens == [t for reply, _, _ in within for line in reply.splitlines() if reply
                      for t in json.loads(line)["token_ids"]]
    assert (len(handler.scheduler.running), handler.scheduler.pool.used) == (0, 0) and not handler.live


def test_a_call_whose_budget_the_steps_between_calls_spent_answers_without_a_step(engine) -> None:
    """Tokens made between calls go out with the next call at once, not behind one more step of its own."""
    body = GREEDY % (b"hi", 20, b', "stream": true')
    handler = new_handler(engine, dataclasses.replace(SETTINGS, decode_call_ms=0))
    first = serve(handler, [[("s", body)]])["s"]  # the prompt's step: one token
    handler.steps.end_between_calls()  # a step or more ran meanwhile; now at rest until the next call
    made = len(handler.live["s"].seqs[0].output)
    assert made >= 2
    second = serve(handler, [[("s", None)]])["s"]
    assert tokens_per_reply(first + second) == [1, made - 1]
    rest = run_to_end(handler, {"s": None})["s"]
    tokens = [t for reply, _, _ in first + second + rest for line in reply.splitlines() for t in json.loads(line)["token_ids"]]
    assert tokens == final_json(run_to_end(new_handler(engine, WITHIN_CALLS), {"s": GREEDY % (b"hi", 20, b"")})["s"])["token_ids"]


def test_a_call_ends_the_steps_between_calls_and_a_new_request_joins(engine) -> None:
    """A call arriving while the steps between calls run ends them after the step in progress; the
    requests of both calls answer as they would alone."""
    long, short = GREEDY % (b"a long story about", 30, b""), GREEDY % (b"short", 3, b"")
    alone = {rid: final_json(run_to_end(new_handler(engine), {rid: body})[rid])
             for rid, body in (("l", long), ("s", short))}
    handler = new_handler(engine, dataclasses.replace(SETTINGS, decode_call_ms=0))
    serve(handler, [[("l", long)]])
    replies = run_to_end(handler, {"l": None, "s": short})  # "l" has been stepping since its first call
    assert {rid: final_json(replies[rid]) for rid in ("l", "s")} == alone
    assert (len(handler.scheduler.running), handler.scheduler.pool.used) == (0, 0) and not handler.live


def test_absent_requests_free_their_slots_and_waiting_ones_get_them(engine) -> None:
    handler = new_handler(engine, WITHIN_CALLS)  # states between calls, so no steps there
    bodies = {f"r{i}": GREEDY % (b"waiting line", 20, b"") for i in range(5)}
    serve(handler, [list(bodies.items())] + [[(rid, None) for rid in bodies]] * 4)  # prompts prefilled in chunks
    assert len(handler.scheduler.running) == 3 and len(handler.scheduler.waiting) == 2
    serve(handler, [[("r3", None), ("r4", None)]] * 3)  # r0-r2's clients left
    assert len(handler.scheduler.running) == 2 and not handler.scheduler.waiting
    assert sorted(handler.live) == ["r3", "r4"]
    serve(handler, [[]])
    assert (len(handler.scheduler.running), handler.scheduler.pool.used) == (0, 0) and not handler.live


def test_an_unexpected_error_fails_only_its_own_request(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    handler = new_handler(engine)
    real_encode = engine.tokenizer.encode

    def fragile(text: str, bos: bool = True, eos: bool = False) -> list[int]:
        if text == "boom":
            raise RuntimeError("tokenizer bug")
        return real_encode(text, bos, eos)

    monkeypatch.setattr(engine.tokenizer, "encode", fragile)
    replies = run_to_end(handler, {"x": b'{"prompt": "boom"}', "y": GREEDY % (b"fine", 2, b"")})
    _, context, idx = replies["x"][0]
    assert context.status[idx] == 500 and "internal error" in final_json(replies["x"])["error"]
    assert len(final_json(replies["y"])["token_ids"]) == 2


def test_a_form_encoded_body_is_a_bad_request(engine) -> None:
    """TorchServe turns an application/x-www-form-urlencoded body (`curl -d '{...}'` without a Content-Type) into
    form fields, so the request reaches the handler with no body at all: docs/api.md answers it with 400."""
    for path in ("", "v1/completions"):
        replies = serve(new_handler(engine), [[("f", None)]], {"f": path})
        reply, context, idx = replies["f"][0]
        assert context.status[idx] == 400, (path, reply)
        assert "Content-Type: application/json" in reply and "ts_stream_next" not in context.headers.get(idx, {})


def test_hostile_corpus_verdicts_with_real_tokenizers(real_tokenizer) -> None:
    """Every hostile body is a 400 (never an internal error); the valid ones parse to their own prompt."""
    settings = HandlerSettings(EngineConfig("/ckpt", max_seq_len=256), default_max_new_tokens=8, max_request_bytes=65536)
    corpus = hostile_corpus(seed=1, max_seq_len=256, max_body=65536, server_cap=262144)
    assert len(corpus) >= 500
    for case in corpus:
        try:
            job = parse_request({"body": case.body}, settings, real_tokenizer, real_tokenizer.n_words)
        except RequestError as exc:
            assert not case.valid and exc.status == 400, (case.category, case.body[:120], exc.status, str(exc))
            continue
        assert case.valid, (case.category, case.body[:120], "accepted")
        payload = case.payload
        assert job.prompt_ids == case.prompt_ids(real_tokenizer)
        assert job.params.max_new_tokens == (payload.get("max_new_tokens") or settings.default_max_new_tokens)


# --- The OpenAI-compatible front door (openai_api) ---------------------------------------------

import tp_llama.serving.openai_api as openai_api
from tp_llama.serving.metrics import (GENERATED_TOKENS, OUTCOMES, PREEMPTIONS, PREFIX_HITS, PREFIX_QUERIES, PROMPT_TOKENS,
                                     REQUESTS, TPOT, TTFT, ServingMetrics)
from tp_llama.serving.openai_api import CHAT, COMPLETIONS, parse_openai
from tp_llama.serving.stream import StopWatcher


def parse_oa(path: str, body: bytes | dict, settings: HandlerSettings = SETTINGS, tokenizer=None):
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    return parse_openai(path, {"body": body}, settings, tokenizer or ByteTokenizer(), 1001, "llama", "r1", 0)


def test_openai_fields_map_onto_the_native_job() -> None:
    native = parse(b'{"prompt": "hi", "max_new_tokens": 5, "temperature": 0.5, "top_p": 0.5, "seed": 3}')
    api = parse_oa(COMPLETIONS, {"model": "anything", "prompt": "hi", "max_tokens": 5, "temperature": 0.5,
                                 "top_p": 0.5, "seed": 3, "user": "u", "n": 1, "echo": False, "logprobs": None,
                                 "stop": "\n", "stream": True, "stream_options": {"include_usage": True}})
    assert api.job == Job(native.prompt_ids, native.params, True)
    assert (api.stops, api.include_usage, api.id, api.model) == (("\n",), True, "cmpl-r1", "llama")
    assert parse_oa(COMPLETIONS, {"prompt": [1000, 104, 105]}).job.prompt_ids == [1000, 104, 105]
    assert parse_oa(COMPLETIONS, {"prompt": "hi"}).job.params.max_new_tokens == SETTINGS.default_max_new_tokens
    chat = parse_oa(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "h"},
                                                                     {"type": "text", "text": "i"}]}],
                           "max_completion_tokens": 4, "stop": ["a", "b"]})
    assert chat.job.prompt_ids == parse(b'{"messages": [{"role": "user", "content": "hi"}]}').prompt_ids
    assert (chat.job.params.max_new_tokens, chat.stops, chat.id) == (4, ("a", "b"), "chatcmpl-r1")
    assert parse_oa(CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).job.params.max_new_tokens == 3
    assert parse_oa(COMPLETIONS, {"prompt": "hi", "ignore_eos": True}).job.params.ignore_eos  # vLLM's extension
    assert not parse_oa(COMPLETIONS, {"prompt": "hi"}).job.params.ignore_eos


def test_a_null_token_limit_is_not_sent() -> None:
    """null means the field is not set, so a client serializing its unset max_tokens as null beside
    max_completion_tokens (or the other way round) gets the limit it sent."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_oa(CHAT, {**chat, "max_tokens": None, "max_completion_tokens": 5}).job.params.max_new_tokens == 5
    assert parse_oa(CHAT, {**chat, "max_completion_tokens": None, "max_tokens": 6}).job.params.max_new_tokens == 6
    both_null = parse_oa(CHAT, {**chat, "max_completion_tokens": None, "max_tokens": None})
    assert both_null.job.params.max_new_tokens == SETTINGS.default_max_new_tokens


@pytest.mark.parametrize(
    "path, body, message, param",
    [
        (COMPLETIONS, {"prompt": "hi", "n": 99}, "n must be in", "n"),
        (COMPLETIONS, {"prompt": "hi", "echo": True}, "echo is not supported", "echo"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs must be in [0, 20]", "logprobs"),
        (COMPLETIONS, {"prompt": "hi", "best_of": 3}, "best_of must be 1", "best_of"),
        (COMPLETIONS, {"prompt": "hi", "presence_penalty": 3}, "presence_penalty must be in [-2, 2]", "presence_penalty"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"1001": 5}}, "token ids in [0, 1001)", "logit_bias"),
        (COMPLETIONS, {"prompt": "hi", "min_p": -0.1}, "min_p must be in [0, 1]", "min_p"),
        (COMPLETIONS, {"prompt": "hi", "ignore_eos": 1}, "ignore_eos must be true or false", "ignore_eos"),
        (COMPLETIONS, {"prompt": "hi", "max_new_tokens": 3}, "Unrecognized request argument", "max_new_tokens"),
        (COMPLETIONS, {"messages": [{"role": "user", "content": "hi"}]}, "Unrecognized request argument", "messages"),
        (COMPLETIONS, {"max_tokens": 3}, "prompt is required", "prompt"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "one prompt per request", "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt must not be empty", "prompt"),
        (COMPLETIONS, {"prompt": [1, 5000]}, "prompt token ids must be in [0, 1001)", "prompt"),
        (COMPLETIONS, {"prompt": [1, True]}, "one prompt per request", "prompt"),
        (COMPLETIONS, {"prompt": ""}, "prompt must not be empty", "prompt"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens must be >= 1", "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 33}, "max_tokens 33 exceeds the limit 32", "max_tokens"),
        (COMPLETIONS, {"prompt": "x" * 60, "max_tokens": 10}, "exceeds max_seq_len 64", "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}, "max_tokens must be an integer", "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "temperature": -1}, "temperature must be >= 0", "temperature"),
        (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p must be in (0, 1]", "top_p"),
        (COMPLETIONS, {"prompt": "hi", "seed": -1}, "seed must be in [0, 2**63)", "seed"),
        (COMPLETIONS, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "1 to 4 strings", "stop"),
        (COMPLETIONS, {"prompt": "hi", "stop": ""}, "must not be empty", "stop"),
        (COMPLETIONS, {"prompt": "hi", "stop": [1]}, "stop strings must be strings", "stop"),
        (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream must be true or false", "stream"),
        (COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": True}}, "only allowed when stream",
         "stream_options"),
        (COMPLETIONS, {"prompt": "hi", "stream": True, "stream_options": {"x": 1}}, "unknown field", "stream_options"),
        (COMPLETIONS, {"prompt": "hi", "model": 3}, "model must be a string", "model"),
        (CHAT, {"prompt": "hi"}, "Unrecognized request argument supplied: prompt", "prompt"),
        (CHAT, {"max_tokens": 3}, "messages is required", "messages"),
        (CHAT, {"messages": []}, "non-empty array", "messages"),
        (CHAT, {"messages": [{"role": "user", "content": "hi", "nmae": "x"}]}, "unknown field(s) ['nmae']", "messages"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                          {"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[1]: image_url parts are not supported: this server is text-only", "messages"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "only text parts",
         "messages"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "max_completion_tokens": 2},
         "only one of", "max_tokens"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
         "tools are off for this model", "tools"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
         "response_format.type must be one of", "response_format"),
        (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}},
         "exactly one", "structured_outputs"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
         "top_logprobs needs logprobs set to true", "top_logprobs"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
         "top_logprobs must be in [0, 20]", "top_logprobs"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs must be true or false",
         "logprobs"),
    ],
)
def test_openai_refusals_name_the_field(path: str, body: dict, message: str, param: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_oa(path, body)
    assert message in str(info.value) and info.value.status == 400
    assert openai_api.error_body(info.value) == {
        "error": {"message": str(info.value), "type": "invalid_request_error", "param": param, "code": None}}


def test_a_lora_path_with_a_nul_byte_is_the_clients_400(tmp_path: Path) -> None:
    """Path.resolve raises a bare ValueError on a NUL byte, which the handler answered as its own 500."""
    from tp_llama.serving.lora_admin import LOAD, admin_request

    (tmp_path / "late").mkdir()
    key = "k" * 16
    settings = HandlerSettings(EngineConfig("/ckpt", lora_folder=str(tmp_path), lora_runtime_loading=True),
                               lora_admin_key=key)
    for sent in ("\0", str(tmp_path / "late") + "\0"):
        with pytest.raises(RequestError, match="lora_path may only repeat") as info:
            admin_request(LOAD, {"body": json.dumps({"lora_name": "late", "lora_path": sent})}, settings, key)
        assert info.value.status == 400
    body = json.dumps({"lora_name": "late", "lora_path": str(tmp_path / "late")})
    assert admin_request(LOAD, {"body": body}, settings, key) == ("late", str(tmp_path / "late"))


class PaddedTokenizer(ByteTokenizer):
    """ByteTokenizer's 1001 ids under a model whose embedding is padded to 1024 rows (Llama 4's is padded)."""

    n_words = 1001


def test_ids_past_the_tokenizer_that_the_sampler_would_index_are_refused() -> None:
    """The sampler's logits stop at the tokenizer's ids, so a logit_bias id past them, or a repetition_penalty
    over a prompt id past them, would fail the step and stop the worker: both are 400s naming the field."""
    def parse_padded(path: str | None, body: dict) -> Job:
        request = {"body": json.dumps(body).encode()}
        if path is None:
            return parse_request(request, SETTINGS, PaddedTokenizer(), 1024)
        return parse_openai(path, request, SETTINGS, PaddedTokenizer(), 1024, "llama", "r1", 0).job

    for path in (None, COMPLETIONS):
        prompt = {"prompt": "hi"}
        assert parse_padded(path, {**prompt, "logit_bias": {"1000": 5}}).params.logit_bias == ((1000, 5.0),)
        with pytest.raises(RequestError, match=r"logit_bias keys must be token ids in \[0, 1001\)") as info:
            parse_padded(path, {**prompt, "logit_bias": {"1010": 5}})
        assert info.value.param == "logit_bias"
    assert parse_padded(COMPLETIONS, {"prompt": [1000, 1010]}).prompt_ids == [1000, 1010]  # a padded row's id
    with pytest.raises(RequestError, match="repetition_penalty") as info:
        parse_padded(COMPLETIONS, {"prompt": [1000, 1010], "repetition_penalty": 1.2})
    assert info.value.param == "prompt" and info.value.status == 400


def test_openai_paths_refuse_every_hostile_body(real_tokenizer) -> None:
    """The hostile corpus's bodies (native requests, valid or not) are all 400s on both OpenAI paths."""
    settings = HandlerSettings(EngineConfig("/ckpt", max_seq_len=256), default_max_new_tokens=8, max_request_bytes=65536)
    corpus = hostile_corpus(seed=1, max_seq_len=256, max_body=65536, server_cap=262144)
    for path in (COMPLETIONS, CHAT):
        for case in corpus:
            with pytest.raises(RequestError) as info:
                parse_openai(path, {"body": case.body}, settings, real_tokenizer, real_tokenizer.n_words, "m", "r")
            assert info.value.status == 400, (path, case.category, case.body[:120], str(info.value))


def test_chat_logprobs_bytes_add_up_to_characters_split_across_tokens(real_tokenizer) -> None:
    """OpenAI's `bytes` exist so that a character split across tokens can be put together: each token's own
    bytes, not those of the U+FFFD its lone bytes decode to."""
    from tp_llama.engine.sampling import TokenLogprobs
    from tp_llama.serving.routes import open_request

    text = "東京🎉"
    ids = real_tokenizer.encode(text, bos=False)
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    api = open_request(CHAT, {"body": json.dumps(body).encode()}, SETTINGS, real_tokenizer, real_tokenizer.n_words,
                       "llama", "r1")
    content = api._logprobs(None, [TokenLogprobs(t, -1.0, [(t, -1.0)]) for t in ids])["content"]
    assert any("\ufffd" in entry["token"] for entry in content), "no character was split; pick another text"
    assert b"".join(bytes(entry["bytes"]) for entry in content) == text.encode("utf-8")
    assert [entry["top_logprobs"][0]["bytes"] for entry in content] == [entry["bytes"] for entry in content]


def test_stop_watcher_cuts_before_the_first_stop_and_holds_back_partial_matches() -> None:
    watcher = StopWatcher(("END", "\n\n"))
    shown = [watcher.feed(p) for p in ("abc E", "N", "x", "yz\n", "\nmore")]
    assert shown == ["abc ", "", "ENx", "yz", ""] and watcher.hit and watcher.text == "abc ENxyz"
    watcher = StopWatcher(("xyz",))
    assert watcher.feed("a") == "a" and watcher.feed("bxy") == "b" and watcher.feed("", final=True) == "xy"
    assert not watcher.hit
    watcher = StopWatcher(("long stop", "s"))
    assert watcher.feed("ab long") == "ab " and watcher.feed(" so") == "long " and watcher.hit
    assert StopWatcher(()).feed("anything") == "anything"


def test_a_repeated_prompt_reports_its_cached_tokens_and_answers_the_same(engine) -> None:
    handler = new_handler(engine)
    prompt = b"the river runs past the old mill"
    body = GREEDY % (prompt, 6, b"")
    cold = final_json(run_to_end(handler, {"a": body})["a"])
    warm = final_json(run_to_end(handler, {"b": body})["b"])
    other = final_json(run_to_end(handler, {"c": GREEDY % (prompt, 6, b', "cache_salt": "tenant-2"')})["c"])
    assert all("usage" in reply for reply in (cold, warm, other)), (cold, warm, other)
    n = cold["usage"]["prompt_tokens"]
    assert n > 16 and cold["usage"]["cached_prompt_tokens"] == 0
    assert warm["usage"]["cached_prompt_tokens"] == (n - 1) // 16 * 16  # every full block but the last token's
    assert other["usage"]["cached_prompt_tokens"] == 0  # another tenant's salt shares nothing
    assert warm["token_ids"] == cold["token_ids"] == other["token_ids"]
    assert handler.scheduler.pool.used == 0
    with pytest.raises(RequestError, match="cache_salt must be a non-empty string"):
        parse_request({"body": {"prompt": "hi", "cache_salt": ""}}, SETTINGS, ByteTokenizer(), 1001)


def _sse(replies: list) -> list:
    text = "".join(reply for reply, _, _ in replies)
    assert text.endswith("data: [DONE]\n\n")
    events = [event for event in text.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events)
    return [json.loads(event[len("data: "):]) for event in events[:-1]]


def test_openai_requests_through_the_handler(engine) -> None:
    native = final_json(run_to_end(new_handler(engine), {"n": GREEDY % (b"hello there", 12, b"")})["n"])
    assert len(native["token_ids"]) == 12, "the tiny model ended early; pick another prompt"
    handler = new_handler(engine)
    body = json.dumps({"prompt": "hello there", "max_tokens": 12, "temperature": 0}).encode()
    stream = json.dumps({"prompt": "hello there", "max_tokens": 12, "temperature": 0, "stream": True,
                         "stream_options": {"include_usage": True}}).encode()
    paths = {"a": COMPLETIONS, "s": COMPLETIONS, "m": openai_api.MODELS, "x": "v1/embeddings", "bad": CHAT}
    replies = run_to_end(handler, {"a": body, "s": stream, "m": None, "x": body, "bad": body}, paths=paths)
    got = final_json(replies["a"])
    assert got["object"] == "text_completion" and got["model"] == "llama"
    assert got["choices"][0]["text"] == native["text"] and got["choices"][0]["finish_reason"] == "length"
    assert got["usage"] == {"prompt_tokens": native["usage"]["prompt_tokens"], "completion_tokens": 12,
                            "total_tokens": native["usage"]["prompt_tokens"] + 12,
                            "prompt_tokens_details": {"cached_tokens": 0}}  # another handler: another pool
    chunks = _sse(replies["s"])
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == native["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == got["usage"]
    _, context, idx = replies["s"][-1]
    assert context.content_types[idx] == "text/event-stream"
    assert final_json(replies["m"])["data"][0]["id"] == "llama"
    for rid, status in (("x", 404), ("bad", 400)):
        _, context, idx = replies[rid][0]
        assert context.status[idx] == status and set(final_json(replies[rid])["error"]) == {
            "message", "type", "param", "code"}
    assert (len(handler.scheduler.running), handler.scheduler.pool.used) == (0, 0) and not handler.live


def test_token_ids_come_back_when_asked_as_vllm_sends_them(engine) -> None:
    native = final_json(run_to_end(new_handler(engine), {"n": GREEDY % (b"hello there", 12, b"")})["n"])
    ask = {"prompt": "hello there", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    paths = {"a": COMPLETIONS, "s": COMPLETIONS}
    replies = run_to_end(new_handler(engine), {"a": json.dumps(ask).encode(),
                                               "s": json.dumps({**ask, "stream": True}).encode()}, paths=paths)
    assert final_json(replies["a"])["choices"][0]["token_ids"] == native["token_ids"]
    streamed = [i for c in _sse(replies["s"]) for choice in c["choices"] for i in choice["token_ids"]]
    assert streamed == native["token_ids"]


def test_a_stop_string_ends_the_generation_there(engine) -> None:
    native = final_json(run_to_end(new_handler(engine), {"n": GREEDY % (b"once upon", 20, b"")})["n"])
    text = native["text"]
    cut = next(i for i in range(4, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stop = text[cut:cut + 3]
    handler = new_handler(engine)
    plain = {"prompt": "once upon", "max_tokens": 20, "temperature": 0, "stop": ["never-there", stop]}
    chat_like = {**plain, "stream": True}
    replies = run_to_end(handler, {"p": json.dumps(plain).encode(), "s": json.dumps(chat_like).encode()},
                         paths={"p": COMPLETIONS, "s": COMPLETIONS})
    got = final_json(replies["p"])
    assert got["choices"][0] == {"index": 0, "text": text[:cut], "logprobs": None, "finish_reason": "stop"}
    assert got["usage"]["completion_tokens"] < 20  # the generation stopped there, not at max_tokens
    chunks = _sse(replies["s"])
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[:cut]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert (len(handler.scheduler.running), handler.scheduler.pool.used) == (0, 0) and not handler.live


class ProposeTheReply(Speculator):
    """Proposes the rest of a known greedy reply, as many tokens as a step lets a row carry: every proposal
    is taken, so a reply takes a few steps of several tokens each."""

    def __init__(self, prompt_tokens: int, reply: list[int]) -> None:
        super().__init__(4, 1, 1)
        self.prompt_tokens, self.reply = prompt_tokens, reply

    def worth(self, seq_id: str) -> bool:
        return True

    def per_row(self, rows: int) -> int:
        return 32

    def propose(self, seq_id: str, tokens, most: int) -> list[int]:
        done = len(tokens) - self.prompt_tokens
        return self.reply[done : done + most]


def streamed(chunks: list[dict]) -> tuple:
    """A completions stream's text, token ids, tokens' log-probabilities, finish reason and usage."""
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    logprobs = [c["logprobs"] for c in choices if c["logprobs"]]
    return ("".join(c["text"] for c in choices), [t for c in choices for t in c["token_ids"]],
            [(t, lp) for p in logprobs for t, lp in zip(p["tokens"], p["token_logprobs"])],
            choices[-1]["finish_reason"], chunks[-1]["usage"])


def test_a_stop_string_inside_a_step_of_several_tokens_ends_the_reply_where_one_token_a_step_would(engine) -> None:
    """Steps that add several tokens to a row (taken proposals) pass a stop string inside them: the reply's
    text, token ids, log-probabilities, finish reason and usage, whole and streamed, are those of the same
    request without proposals."""
    native = final_json(run_to_end(new_handler(engine), {"n": GREEDY % (b"once upon", 24, b"")})["n"])
    text = native["text"]
    firsts = [text[i:i + 3] for i in range(2, len(text) - 3) if text.find(text[i:i + 3]) == i]
    shown = [w for w in firsts if w.strip() and w.isprintable() and "\ufffd" not in w]  # as a stream shows it
    stops = [shown[0], shown[len(shown) // 2], shown[-1]]
    bodies, paths = {}, {}
    for j, stop in enumerate(stops):
        ask = {"prompt": "once upon", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop],
               "logprobs": 2, "return_token_ids": True}
        bodies[f"w{j}"] = json.dumps(ask).encode()
        bodies[f"s{j}"] = json.dumps({**ask, "stream": True, "stream_options": {"include_usage": True}}).encode()
        paths[f"w{j}"] = paths[f"s{j}"] = COMPLETIONS
    proposer = ProposeTheReply(native["usage"]["prompt_tokens"], native["token_ids"])
    replies = {}
    for name, on in (("plain", engine), ("proposals", Engine.load(dataclasses.replace(engine.config, prefill_budget=64)))):
        handler = new_handler(on)
        handler.scheduler.speculator = proposer if name == "proposals" else None
        replies[name] = run_to_end(handler, bodies, paths=paths)
        assert (len(handler.scheduler.running), handler.scheduler.pool.used) == (0, 0) and not handler.live
    assert proposer.accepted >= 10  # the replies came in steps of several tokens
    for j, stop in enumerate(stops):
        plain, spec = (final_json(replies[name][f"w{j}"]) for name in ("plain", "proposals"))
        assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] < 24, stop
        assert (spec["choices"], spec["usage"]) == (plain["choices"], plain["usage"]), stop
        assert streamed(_sse(replies["proposals"][f"s{j}"])) == streamed(_sse(replies["plain"][f"s{j}"])), stop


def test_logprobs_in_every_shape_agree_with_the_tokens(engine) -> None:
    """Greedy picks the most likely token, so each token's log-probability is the first of its list;
    the native API, completions and chat give the same numbers, whole and streamed."""
    prompt = {"prompt": "hello there", "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "hello there"}], "temperature": 0, "ignore_eos": True}
    bodies = {"n": {**prompt, "max_new_tokens": 6, "logprobs": 3}, "ns": {**prompt, "max_new_tokens": 6, "logprobs": 3,
                                                                           "stream": True},
              "c": {**prompt, "max_tokens": 6, "logprobs": 3}, "cs": {**prompt, "max_tokens": 6, "logprobs": 3,
                                                                    "stream": True},
              "h": {**chat, "max_tokens": 6, "logprobs": True, "top_logprobs": 2},
              "hs": {**chat, "max_tokens": 6, "logprobs": True, "stream": True}}
    paths = {"c": COMPLETIONS, "cs": COMPLETIONS, "h": CHAT, "hs": CHAT}
    replies = run_to_end(new_handler(engine), {k: json.dumps(v).encode() for k, v in bodies.items()}, paths=paths)
    native = final_json(replies["n"])
    assert len(native["logprobs"]) == len(native["token_ids"]) == 6
    for token, entry in zip(native["token_ids"], native["logprobs"]):
        assert entry["token_id"] == token and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0] == {"token_id": token, "logprob": entry["logprob"]} and entry["logprob"] <= 0
        assert [t["logprob"] for t in entry["top_logprobs"]] == sorted((t["logprob"] for t in entry["top_logprobs"]),
                                                                      reverse=True)
    lines = [json.loads(reply) for reply, _, _ in replies["ns"] if reply]
    streamed = [e for line in lines for e in line["logprobs"]]
    # The same tokens and numbers within rounding: the two prompts may be prefilled in different chunks
    # (the budget of 8 rows shares each step with the other requests).
    assert [[t["token_id"] for t in e["top_logprobs"]] for e in streamed] == \
        [[t["token_id"] for t in e["top_logprobs"]] for e in native["logprobs"]]
    assert [t["logprob"] for e in streamed for t in e["top_logprobs"]] == \
        pytest.approx([t["logprob"] for e in native["logprobs"] for t in e["top_logprobs"]], abs=1e-5)
    values = [e["logprob"] for e in native["logprobs"]]
    completion = final_json(replies["c"])["choices"][0]["logprobs"]
    assert completion["token_logprobs"] == pytest.approx(values, abs=1e-5) and len(completion["top_logprobs"][0]) <= 3
    assert completion["tokens"] == [engine.tokenizer.decode([t]) for t in native["token_ids"]]
    assert completion["text_offset"] == [sum(map(len, completion["tokens"][:i])) for i in range(6)]
    streamed = [c["choices"][0]["logprobs"] for c in _sse(replies["cs"]) if c["choices"] and c["choices"][0]["logprobs"]]
    assert [v for lp in streamed for v in lp["token_logprobs"]] == pytest.approx(values, abs=1e-5)
    assert [o for lp in streamed for o in lp["text_offset"]] == completion["text_offset"]
    message = final_json(replies["h"])["choices"][0]
    content = message["logprobs"]["content"]
    assert len(content) == 6 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    # Each token's own bytes (a lone byte's too), so together they are the reply's text.
    joined = b"".join(bytes(entry["bytes"]) for entry in content)
    assert joined.decode("utf-8", errors="replace") == message["message"]["content"]
    streamed = [e for c in _sse(replies["hs"]) if c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)
    assert all(e["top_logprobs"] == [] for e in streamed)


def test_a_completions_top_logprobs_dict_keeps_the_best_of_tokens_of_equal_text(engine) -> None:
    """Lone bytes all decode to U+FFFD, so the tiny model's top tokens often share a text: its key holds the best
    of their log-probabilities (what lm-evaluation-harness's greedy check reads), as the native API lists them."""
    ask = {"prompt": "once upon a time", "temperature": 0, "ignore_eos": True, "logprobs": 5}
    replies = run_to_end(new_handler(engine), {"n": json.dumps({**ask, "max_new_tokens": 8}).encode(),
                                               "c": json.dumps({**ask, "max_tokens": 8}).encode()},
                         paths={"c": COMPLETIONS})
    want, shared = [], 0
    for entry in final_json(replies["n"])["logprobs"]:
        texts = [(engine.tokenizer.decode([t["token_id"]]), t["logprob"]) for t in entry["top_logprobs"]]
        shared += len(texts) - len({text for text, _ in texts})
        want.append({text: max(v for t, v in texts if t == text) for text, _ in texts})
    assert shared, "no two top tokens share a text; pick another prompt"
    got = final_json(replies["c"])["choices"][0]["logprobs"]["top_logprobs"]
    assert [list(d) for d in got] == [list(d) for d in want]
    assert [list(d.values()) for d in got] == [pytest.approx(list(d.values()), abs=1e-5) for d in want]


def test_sampling_fields_reach_the_engine(engine) -> None:
    """A seeded request repeats itself; logit_bias forces a token at temperature 0; top_k 1 is greedy.
    (What each filter and penalty does to the distribution: tests/test_sampling.py.)"""
    base = {"prompt": "once upon", "max_new_tokens": 8, "ignore_eos": True}
    bodies = {"s1": {**base, "temperature": 1.0, "seed": 5}, "s2": {**base, "temperature": 1.0, "seed": 5},
              "g": {**base, "temperature": 0}, "k1": {**base, "temperature": 1.5, "top_k": 1},
              "b": {**base, "temperature": 0, "logit_bias": {"77": 100}},
              "r": {**base, "temperature": 0.7, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.3,
                    "frequency_penalty": 1.0, "presence_penalty": 0.5}}
    replies = run_to_end(new_handler(engine), {k: json.dumps(v).encode() for k, v in bodies.items()})
    got = {rid: final_json(r)["token_ids"] for rid, r in replies.items()}
    assert got["s1"] == got["s2"] and got["k1"] == got["g"] and got["b"] == [77] * 8
    assert len(got["r"]) == 8


def test_a_temperature_near_zero_picks_the_greedy_tokens(engine) -> None:
    """As the temperature goes to 0 sampling becomes greedy, also below float32's normal numbers (1e-40),
    where dividing the logits by it overflowed and every draw was id 0."""
    base = {"prompt": "hello there", "max_new_tokens": 6, "ignore_eos": True, "seed": 1}
    bodies = {f"t{t}": json.dumps({**base, "temperature": t}).encode() for t in (0, 1e-6, 1e-40, 1e-300)}
    replies = run_to_end(new_handler(engine), bodies)
    got = {rid: final_json(reply)["token_ids"] for rid, reply in replies.items()}
    assert len(set(got["t0"])) > 1, "the greedy reply repeats one token; pick another prompt"
    assert got["t1e-06"] == got["t1e-40"] == got["t1e-300"] == got["t0"], got


def stop_raises(rank: int, error: BaseException):
    """In place of _stop_worker, which would end the test process: the failed step's error, raised by handle."""
    raise AssertionError(f"the step failed, which stops the worker: {error!r}") from error


@pytest.mark.parametrize("sampler", ["c", "torch"])
def test_a_top_k_past_the_vocabulary_keeps_every_token(engine, monkeypatch: pytest.MonkeyPatch, sampler: str) -> None:
    """top_k of the vocabulary or more is no limit, however large: PyTorch's sampler (a GPU's) could not hold one
    past int64 (the step failed, and with it the worker), and the C kernels read k modulo 2**64."""
    monkeypatch.setattr(llama_handler, "_stop_worker", stop_raises)
    if sampler == "torch":
        monkeypatch.setattr("tp_llama.engine.sampling.in_c", lambda logits: False)
    base = {"prompt": "once upon", "max_new_tokens": 8, "ignore_eos": True, "temperature": 1.5, "seed": 3}
    bodies = {str(k): json.dumps({**base, "top_k": k}).encode() for k in (0, 1, 512, 2**63, 2**64 + 1, 10**30)}
    replies = run_to_end(new_handler(engine), bodies)
    got = {rid: final_json(reply)["token_ids"] for rid, reply in replies.items()}
    assert got["0"] != got["1"], "the draw is the greedy one; pick another seed"
    assert got["512"] == got[str(2**63)] == got[str(2**64 + 1)] == got[str(10**30)] == got["0"], got
    assert parse(b'{"prompt": "hi", "top_k": 18446744073709551617}').params.top_k == 0


def test_chat_stream_starts_with_the_assistant_role(engine) -> None:
    handler = new_handler(engine)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
                       "temperature": 0, "stream": True}).encode()
    chunks = _sse(run_to_end(handler, {"c": body}, paths={"c": CHAT})["c"])
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in c for c in chunks)


class FakeMetricCache:
    """TorchServe's context.metrics: records every update."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, float, list[str]]] = []

    def add_metric_to_cache(self, name, unit, dims, kind):
        cache = self

        class Metric:
            def add_or_update(self, value, dimension_values):
                assert len(dimension_values) == len(dims)
                cache.updates.append((name, value, list(dimension_values)))
        return Metric()

    def total(self, name: str, *labels: str) -> float:
        return sum(v for n, v, d in self.updates if n == name and d[1:] == list(labels))


def test_metrics_count_tokens_requests_and_first_tokens(engine) -> None:
    handler = new_handler(engine, WITHIN_CALLS)  # the cancelled request must not end between calls
    cache = FakeMetricCache()
    handler.metrics = ServingMetrics(cache, "llama", 3)
    bodies = {f"r{i}": GREEDY % (b"count me", 3 + i, b"") for i in range(4)}
    bodies["bad"] = b'{"prompt": 1}'
    replies = run_to_end(handler, bodies)
    ok = [final_json(replies[f"r{i}"]) for i in range(4)]
    assert cache.total(GENERATED_TOKENS) == sum(r["usage"]["completion_tokens"] for r in ok) == 3 + 4 + 5 + 6
    assert cache.total(PROMPT_TOKENS) == sum(r["usage"]["prompt_tokens"] for r in ok)
    assert (cache.total(REQUESTS, "ok"), cache.total(REQUESTS, "4xx"), cache.total(REQUESTS, "failed")) == (4, 1, 0)
    assert sum(1 for n, _, _ in cache.updates if n == TTFT) == 4
    assert sum(1 for n, _, _ in cache.updates if n == TPOT) == 4
    assert all(d[0] == "llama" for _, _, d in cache.updates)
    # Every counter series is sent once as 0 at the start, and after that only when it grew.
    counters = {REQUESTS, PROMPT_TOKENS, GENERATED_TOKENS, PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS}
    zeros = [(n, tuple(d)) for n, v, d in cache.updates if n in counters and v == 0]
    assert len(zeros) == len(set(zeros)) == len(OUTCOMES) + 5
    serve(handler, [[("long", GREEDY % (b"long one", 20, b""))], [("long", None)], []])  # its client left
    assert cache.total(REQUESTS, "cancelled") == 1 and handler.metrics.gauges["llama_kv_cache_blocks_used"] == 0


def test_a_503_counts_as_unavailable_not_failed(engine) -> None:
    """The handler's 503 (every LoRA slot busy: retry later) is neither the client's 4xx nor an internal failure."""
    handler = new_handler(engine)
    cache = FakeMetricCache()
    handler.metrics = ServingMetrics(cache, "llama", 3)
    handler.context = FakeContext(["busy", "broken"], None)
    handler._reply(0, "busy", ("openai", RequestError("all 1 LoRA adapter slots hold adapters in use", 503)))
    handler._reply(1, "broken", ("openai", RequestError("internal", 500)))
    handler.metrics.flush()
    assert [cache.total(REQUESTS, outcome) for outcome in ("unavailable", "failed", "4xx")] == [1, 1, 0]
    assert handler.context.status == {0: 503, 1: 500}


def test_a_request_past_response_timeout_ends_and_frees_its_slot(engine) -> None:
    handler = new_handler(engine, WITHIN_CALLS)  # the request must not end between calls
    handler.response_timeout_s = 0.2
    body = GREEDY % (b"a long story", 30, b"")
    first = serve(handler, [[("slow", body)]])["slow"]
    assert first[0][0] == "" and len(handler.scheduler.running) == 1
    time.sleep(0.3)
    replies = run_to_end(handler, {"slow": None})["slow"]
    reply = final_json(replies)
    assert "responseTimeout" in reply["error"] and reply["finish_reason"] == "timeout"
    assert reply["usage"]["completion_tokens"] < 30
    assert (len(handler.scheduler.running), handler.scheduler.pool.used) == (0, 0) and not handler.live


def test_a_streamed_request_past_response_timeout_sends_the_tokens_its_usage_counts(engine) -> None:
    """Tokens made between calls went unsent when the next call ended the request, yet its usage counted them."""
    handler = new_handler(engine, dataclasses.replace(SETTINGS, decode_call_ms=0))
    first = serve(handler, [[("s", GREEDY % (b"hi", 30, b', "stream": true'))]])["s"]  # the prompt's step: one token
    handler.steps.end_between_calls()  # a step or more ran meanwhile, their tokens not sent yet
    assert len(handler.live["s"].seqs[0].output) >= 2
    handler.response_timeout_s = 0.0
    replies = first + serve(handler, [[("s", None)]])["s"]
    lines = [json.loads(line) for reply, _, _ in replies for line in reply.splitlines()]
    assert lines[-1]["finish_reason"] == "timeout" and "responseTimeout" in lines[-1]["error"]
    assert sum(len(line.get("token_ids", [])) for line in lines) == lines[-1]["usage"]["completion_tokens"]
    assert (len(handler.scheduler.running), handler.scheduler.pool.used) == (0, 0) and not handler.live


def test_a_request_id_twice_in_one_call_is_a_400_for_the_repeat_and_changes_no_other_reply(engine) -> None:
    """TorchServe never sends an id twice in a call; where it did, the first one's last reply forgot the id and
    the repeat's raised KeyError, failing every request of the call."""
    a, b = GREEDY % (b"hello there", 3, b""), GREEDY % (b"once upon", 4, b"")
    alone = {rid: final_json(run_to_end(new_handler(engine), {rid: body})[rid]) for rid, body in (("a", a), ("b", b))}
    handler = new_handler(engine)
    replies = serve(handler, [[("a", a), ("b", b), ("a", a)]])
    reply, context, idx = replies["a"][1]  # the repeat
    assert idx == 2 and context.status[idx] == 400 and "twice" in json.loads(reply)["error"]
    streaming = lambda got: got[1].headers.get(got[2], {}).get("ts_stream_next") == "true"  # noqa: E731
    pending = {rid for rid, got in replies.items() if streaming(got[0])}
    for _ in range(100):
        if not pending:
            break
        for rid, got in serve(handler, [[(rid, None) for rid in sorted(pending)]]).items():
            replies[rid].extend(got)
            if not streaming(got[-1]):
                pending.discard(rid)
    assert not pending and final_json(replies["a"]) == alone["a"] and final_json(replies["b"]) == alone["b"]
    assert (len(handler.scheduler.running), handler.scheduler.pool.used) == (0, 0) and not handler.live
