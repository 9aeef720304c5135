"""The OpenAI-compatible endpoints on a real TorchServe, driven by the official `openai` client.

One synthetic Llama 3 checkpoint (chat template with special tokens) served by a 2-rank worker
in float32, so greedy replies can be compared exactly with the native API's.
base_url is http://127.0.0.1:PORT/predictions/llama/1.0/v1 (the archive's version is 1.0;
TorchServe passes the rest of the path to the handler as the `url_path` header).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import jsonschema
import pytest
import re
import torch

openai = pytest.importorskip("openai")


from tests.support.hostile_corpus import Case, hostile_corpus, hostile_grammars
from tests.support.hostile_responses import hostile_responses, hostile_tokenizer_bodies
from tests.support.reference import ReferenceModel
from tests.support.serving_util import TorchServe

PROMPT = "Grüße aus Köln: the quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there ✓"}]
MAX_NEW = 24
MAX_SEQ_LEN = 2048  # room for the tools' definitions in a prompt of the small test tokenizer
NEW_TOKENS_LIMIT = 200
MAX_BODY = 65536
SERVER_CAP = 262144
DTYPE = "float32"  # exact comparisons: bfloat16 rounding depends on the batch a row runs in
ADMIN_KEY = "lora-admin-key-of-the-test"


@pytest.fixture(scope="module")
def checkpoint(synthetic_checkpoint) -> Path:
    return synthetic_checkpoint("llama3")


@pytest.fixture(scope="module")
def adapters(checkpoint: Path, tmp_path_factory) -> Path:
    """The server's folder of LoRA adapters (PEFT's files): `terse`, which the yaml names twice (as itself and
    as terse-copy), and `late`, which a client loads while it serves."""
    from bench.lib.lora_adapters import write_adapter
    from tp_llama.checkpoint.params import read_params
    from tp_llama.tokenizer import load_tokenizer

    args = read_params(checkpoint, load_tokenizer(checkpoint / "tokenizer.model").n_words)
    folder = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(("terse", "late")):
        write_adapter(folder / name, args, rank=8, seed=seed)
    return folder


@pytest.fixture(scope="module")
def server(checkpoint: Path, adapters: Path, serve):
    with serve(checkpoint, max_seq_len=MAX_SEQ_LEN, max_new_tokens_limit=NEW_TOKENS_LIMIT,
               default_max_new_tokens=MAX_NEW, max_request_bytes=MAX_BODY, dtype=DTYPE, batchSize=12,
               lora_adapters={"terse": str(adapters / "terse"), "terse-copy": str(adapters / "terse")},
               lora_folder=str(adapters), lora_runtime_loading="true", lora_admin_key=ADMIN_KEY,
               extra_config=[f"max_request_size={SERVER_CAP}"]) as ts:
        yield ts


@pytest.fixture(scope="module")
def client(server: TorchServe):
    base_url = f"http://127.0.0.1:{server.inference_port}/predictions/llama/1.0/v1"
    with openai.OpenAI(base_url=base_url, api_key=server.keys()["inference"], max_retries=0, timeout=120) as c:
        yield c


def native(server: TorchServe, **payload) -> dict:
    reply = server.predict({"max_new_tokens": MAX_NEW, "temperature": 0, **payload})
    assert reply.status == 200, reply.body
    return reply.json()


def openai_reason(native_reply: dict) -> str:
    return {"stop": "stop", "length": "length"}[native_reply["finish_reason"]]


def test_completion_equals_the_native_reply(server: TorchServe, client) -> None:
    want = native(server, prompt=PROMPT)
    got = client.completions.create(model="llama", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, user="t")
    assert got.object == "text_completion" and got.model == "llama" and got.id.startswith("cmpl-")
    assert len(got.choices) == 1
    assert got.choices[0].text == want["text"]
    assert got.choices[0].finish_reason == openai_reason(want)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want["usage"]["prompt_tokens"],
                                                                       want["usage"]["completion_tokens"])
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_token_id_prompt_equals_the_text_prompt(server: TorchServe, client, tokenizer) -> None:
    want = native(server, prompt=PROMPT)
    ids = tokenizer.encode(PROMPT, bos=True)
    got = client.completions.create(model="llama", prompt=ids, max_tokens=MAX_NEW, temperature=0)
    assert got.choices[0].text == want["text"] and got.usage.prompt_tokens == len(ids)


def test_streamed_completion_adds_up_and_reports_usage(server: TorchServe, client) -> None:
    want = native(server, prompt=PROMPT)
    chunks = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert len(chunks) >= 3 and all(c.object == "text_completion" for c in chunks)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == want["text"]
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == openai_reason(want)
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == want["usage"]["completion_tokens"]
    assert all(c.usage is None for c in text_chunks)


def test_chat_equals_the_native_messages_reply(server: TorchServe, client) -> None:
    want = native(server, messages=MESSAGES)
    got = client.chat.completions.create(model="llama", messages=MESSAGES, max_completion_tokens=MAX_NEW,
                                         temperature=0, seed=1)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want["text"]
    assert got.choices[0].finish_reason == openai_reason(want)
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    streamed = list(client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=MAX_NEW,
                                                   temperature=0, stream=True))
    assert streamed[0].object == "chat.completion.chunk" and streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want["text"]
    assert streamed[-1].choices[0].finish_reason == openai_reason(want)


def test_logprobs_penalties_and_bias_through_the_official_client(server: TorchServe, client) -> None:
    """The client parses our logprobs objects; they agree with the native API's, and the sampling
    fields OpenAI and vLLM clients send are honoured."""
    want = native(server, prompt=PROMPT, logprobs=2)
    values = [entry["logprob"] for entry in want["logprobs"]]
    got = client.completions.create(model="llama", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, logprobs=2)
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(values, abs=1e-5)
    assert all(len(top) <= 2 for top in got.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model="llama", messages=MESSAGES, max_completion_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-6) for c in content)  # greedy: the best
    forced = client.completions.create(model="llama", prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={"77": 100}, frequency_penalty=0.5, presence_penalty=0.5,
                                       extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1,
                                                   "ignore_eos": True})
    assert forced.usage.completion_tokens == 4 and native(server, prompt=PROMPT, max_new_tokens=4,
                                                         logit_bias={"77": 100})["token_ids"] == [77] * 4


def test_stop_strings_cut_the_text_and_end_the_generation(server: TorchServe, client) -> None:
    want = native(server, prompt=PROMPT, max_new_tokens=60)
    text = want["text"]
    cut = next(i for i in range(3, len(text) - 4) if text.find(text[i:i + 4]) == i and text[i:i + 4].strip())
    stop = text[cut:cut + 4]
    got = client.completions.create(model="llama", prompt=PROMPT, max_tokens=60, temperature=0,
                                    stop=["\x00never", stop])
    assert got.choices[0].text == text[:cut] and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens < 60, "the generation went on after the stop string"
    pieces = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=60, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in pieces) == text[:cut]
    assert pieces[-1].choices[0].finish_reason == "stop"


def reference_logprobs(checkpoint: Path, tokenizer, ids: list[int]) -> torch.Tensor:
    """log_softmax of the float64 reference model's logits [len(ids), V] on the checkpoint's weights."""
    return torch.log_softmax(ReferenceModel.load(checkpoint, tokenizer.n_words).logits(ids), dim=-1)


def test_echo_scores_a_batch_of_token_id_prompts(client, checkpoint: Path, tokenizer) -> None:
    """lm-evaluation-harness's log-likelihood request: token-id prompts, echo, logprobs, max_tokens 0 or 1.
    Each prompt token's log-probability (the first null) and top 2 against the float64 reference, on
    the TP 2 worker, whose ranks each reduce their half of the vocabulary; an echo request never reads
    the prefix cache, which holds the first prompt's blocks."""
    first, second = tokenizer.encode(PROMPT, bos=True), tokenizer.encode("the lamp at dusk", bos=True)
    for _ in range(2):
        cached = client.completions.create(model="llama", prompt=first, max_tokens=1, temperature=0)
    assert cached.usage.prompt_tokens_details.cached_tokens > 0
    got = client.completions.create(model="llama", prompt=[first, second], max_tokens=0, echo=True, logprobs=2,
                                    temperature=0)
    assert [c.index for c in got.choices] == [0, 1] and got.usage.completion_tokens == 0
    assert got.usage.prompt_tokens == len(first) + len(second) and got.usage.prompt_tokens_details.cached_tokens == 0
    for choice, ids in zip(got.choices, (first, second)):
        lp = choice.logprobs
        assert choice.finish_reason == "length" and choice.text == tokenizer.decode(ids)
        assert lp.tokens == [tokenizer.decode([t]) for t in ids] and len(lp.text_offset) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = reference_logprobs(checkpoint, tokenizer, ids)
        assert lp.token_logprobs[1:] == pytest.approx([float(want[j, ids[j + 1]]) for j in range(len(ids) - 1)],
                                                      abs=2e-4)
        # Tokens whose texts are equal (lone bytes decode to U+FFFD) share a key: those dicts hold fewer.
        whole = [(j, top) for j, top in enumerate(lp.top_logprobs[1:]) if len(top) == 2]
        assert len(whole) >= len(ids) // 2
        for j, top in whole:
            best = want[j].topk(2).values.tolist()
            assert sorted(top.values(), reverse=True) == pytest.approx(best, abs=2e-4)
            if int(want[j].argmax()) == ids[j + 1] and best[0] - best[1] > 1e-3:  # lm-eval's "is greedy"
                assert lp.token_logprobs[j + 1] == max(top.values())
    generated = client.completions.create(model="llama", prompt=[second], max_tokens=1, echo=True, logprobs=1,
                                          temperature=0, seed=1234)
    plain = client.completions.create(model="llama", prompt=second, max_tokens=1, logprobs=1, temperature=0)
    lp = generated.choices[0].logprobs
    assert len(lp.tokens) == len(second) + 1 and lp.tokens[-1] == plain.choices[0].logprobs.tokens[0]
    assert lp.token_logprobs[:-1] == pytest.approx(got.choices[1].logprobs.token_logprobs, abs=1e-5)
    assert lp.token_logprobs[-1] == pytest.approx(plain.choices[0].logprobs.token_logprobs[0], abs=1e-5)
    assert generated.choices[0].text == tokenizer.decode(second) + plain.choices[0].text


def test_echo_streams_and_batches_like_the_whole_reply(client, tokenizer) -> None:
    """A streamed echo adds up to the whole reply; a batch of prompts answers each as it answers alone."""
    ids = tokenizer.encode(PROMPT, bos=True)
    ask = {"model": "llama", "prompt": ids, "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0}
    whole = client.completions.create(**ask).choices[0]
    chunks = list(client.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)
    batch = client.completions.create(model="llama", prompt=[ids, ids[:5]], max_tokens=6, temperature=0, stop=["\n"])
    alone = client.completions.create(model="llama", prompt=ids[:5], max_tokens=6, temperature=0, stop=["\n"])
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[1].text == alone.choices[0].text


def test_models_list_is_served_by_the_handler(client) -> None:
    models = client.models.list()
    assert [(m.id, m.parent) for m in models.data] == [("llama", None), ("terse", "llama"), ("terse-copy", "llama")]


def test_the_model_field_picks_a_lora_adapter_on_both_apis(server: TorchServe, client) -> None:
    def completion(model: str):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)

    base, terse, copy = completion("llama"), completion("terse"), completion("terse-copy")
    assert terse.model == "terse" and terse.choices[0].text == copy.choices[0].text
    assert terse.choices[0].text != base.choices[0].text  # the adapter changes the reply
    assert native(server, prompt=PROMPT, model="terse")["text"] == terse.choices[0].text
    # n and structured outputs per adapter: each choice on the adapter, a constrained reply valid JSON.
    pair = client.completions.create(model="terse", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, n=2)
    assert [c.text for c in pair.choices] == [terse.choices[0].text] * 2
    constrained = client.chat.completions.create(model="terse", messages=MESSAGES, max_tokens=MAX_NEW,
                                                 response_format={"type": "json_object"}, temperature=0)
    assert constrained.model == "terse" and constrained.choices[0].message.content.startswith("{")
    with pytest.raises(openai.NotFoundError) as refused:
        completion("tersely")
    error = refused.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model" and "terse-copy" in error["message"]


def test_an_adapter_loads_and_unloads_while_serving_behind_the_admin_key(server: TorchServe, client) -> None:
    def admin(path: str, body: dict, key: str | None = ADMIN_KEY):
        reply = server.request("POST", f"/predictions/llama/1.0/v1/{path}", json.dumps(body).encode(),
                               headers={"X-Lora-Admin-Key": key} if key else None)
        return reply.status, reply.json()

    def late():
        return client.completions.create(model="late", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)

    with pytest.raises(openai.NotFoundError):
        late()
    assert admin("load_lora_adapter", {"lora_name": "late"}, key=None)[0] == 403
    assert admin("load_lora_adapter", {"lora_name": "late"}, key="wrong" * 8)[0] == 403
    assert admin("load_lora_adapter", {"lora_name": "../late"})[0] == 400  # a name, never a path
    assert admin("load_lora_adapter", {"lora_name": "late", "lora_path": "/etc"})[0] == 400
    assert admin("load_lora_adapter", {"lora_name": "missing"})[0] == 404
    assert admin("load_lora_adapter", {"lora_name": "late"}) == (200, {"object": "lora_adapter", "name": "late",
                                                                      "status": "loaded"})
    loaded = late()
    assert loaded.model == "late" and "late" in [m.id for m in client.models.list().data]
    assert loaded.choices[0].text != client.completions.create(model="terse", prompt=PROMPT, max_tokens=MAX_NEW,
                                                               temperature=0).choices[0].text
    assert admin("unload_lora_adapter", {"lora_name": "late"})[0] == 200
    with pytest.raises(openai.NotFoundError):
        late()
    assert admin("load_lora_adapter", {"lora_name": "late"})[0] == 200  # back, the same reply
    assert late().choices[0].text == loaded.choices[0].text
    assert admin("unload_lora_adapter", {"lora_name": "late"})[0] == 200


@pytest.mark.parametrize("call, param", [
    (lambda c: c.completions.create(model="llama", prompt=PROMPT, n=99), "n"),
    (lambda c: c.completions.create(model="llama", prompt=PROMPT, echo=True), "echo"),
    (lambda c: c.completions.create(model="llama", prompt=PROMPT, echo=True, logprobs=6), "logprobs"),
    (lambda c: c.completions.create(model="llama", prompt=[[1, 2], []], echo=True, logprobs=1), "prompt"),
    (lambda c: c.completions.create(model="llama", prompt=[[1, 10**9]], echo=True, logprobs=1), "prompt"),
    (lambda c: c.completions.create(model="llama", prompt=PROMPT, max_tokens=0), "max_tokens"),
    (lambda c: c.completions.create(model="llama", prompt=PROMPT, logprobs=21), "logprobs"),
    (lambda c: c.completions.create(model="llama", prompt=PROMPT, temperature=-1), "temperature"),
    (lambda c: c.completions.create(model="llama", prompt=PROMPT, max_tokens=NEW_TOKENS_LIMIT + 1), "max_tokens"),
    (lambda c: c.completions.create(model="llama", prompt=PROMPT, stop=["a", "b", "c", "d", "e"]), "stop"),
    (lambda c: c.completions.create(model="llama", prompt=[10**9]), "prompt"),
    (lambda c: c.completions.create(model="llama", prompt=PROMPT, extra_body={"colour": "red"}), "colour"),
    (lambda c: c.chat.completions.create(model="llama", messages=[{"role": "robot", "content": "x"}]), "messages"),
    (lambda c: c.chat.completions.create(model="llama", messages=MESSAGES, seed=-1), "seed"),
    (lambda c: c.chat.completions.create(
        model="llama", messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (lambda c: c.chat.completions.create(model="llama", messages=MESSAGES, response_format={
        "type": "json_schema", "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}}}),
     "response_format"),
])
def test_bad_requests_raise_bad_request_error(client, call, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call(client)
    assert info.value.status_code == 400
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_a_wrong_key_is_refused(server: TorchServe) -> None:
    base_url = f"http://127.0.0.1:{server.inference_port}/predictions/llama/1.0/v1"
    with openai.OpenAI(base_url=base_url, api_key="not-the-key", max_retries=0, timeout=60) as bad:
        with pytest.raises(openai.APIStatusError) as info:
            bad.completions.create(model="llama", prompt=PROMPT, max_tokens=2)
    assert 400 <= info.value.status_code < 500


def _post(server: TorchServe, path: str, body: bytes):
    return server.request("POST", f"/predictions/llama/1.0/{path}", body, timeout=120)


@contextmanager
def long_requests_beside(client):
    """Long streamed greedy completions run back to back while the block runs; yields (the text such a
    request has alone, the list of the texts of those that ran beside)."""
    long = {"model": "llama", "prompt": PROMPT, "max_tokens": NEW_TOKENS_LIMIT, "temperature": 0}
    alone = client.completions.create(**long).choices[0].text
    stop, beside = threading.Event(), []

    def keep_running() -> None:
        while not stop.is_set():
            beside.append("".join(c.choices[0].text for c in client.completions.create(**long, stream=True)))

    runner = threading.Thread(target=keep_running, daemon=True)
    runner.start()
    try:
        yield alone, beside
    finally:
        stop.set()
        runner.join(timeout=180)


def test_hostile_bodies_get_4xx_and_never_disturb_the_running_batch(server: TorchServe, client) -> None:
    """Every hostile body on both OpenAI paths (and those made for the Responses and tokenizer paths) is a 4xx in OpenAI's error shape, while long streamed
    greedy requests keep running beside them and end exactly as they do alone."""
    cases = hostile_corpus(seed=11, max_seq_len=MAX_SEQ_LEN, max_body=MAX_BODY, server_cap=SERVER_CAP)
    problems: list[str] = []

    def one(job) -> int:
        path, case = job
        reply = _post(server, path, case.body)
        if not 400 <= reply.status < 500:
            problems.append(f"{path} {case.category} {case.body[:60]!r}: {reply.status} {reply.body[:200]!r}")
        elif reply.status != 413:  # the frontend's own size cap answers before any handler runs
            error = json.loads(reply.body).get("error", {})
            if set(error) != {"message", "type", "param", "code"}:
                problems.append(f"{path} {case.category}: not OpenAI's error shape: {reply.body[:200]!r}")
        return reply.status

    started = time.monotonic()
    jobs = [(path, case) for case in cases for path in ("v1/completions", "v1/chat/completions")]
    # A sample of the Responses and tokenizer corpora here, beside the batch (tests/test_responses.py sends all).
    jobs += [("v1/responses", Case("responses", body)) for body in hostile_responses()[::4]]
    jobs += [(path, Case("tokenizer", body)) for path, body in hostile_tokenizer_bodies()[::4]]
    with long_requests_beside(client) as (alone, beside), ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(one, jobs))
    print(f"\n{len(jobs)} hostile bodies in {time.monotonic() - started:.1f} s; "
          f"{len(beside)} long requests ran beside them")
    assert not problems, "\n".join(problems[:20])
    assert len(statuses) == len(jobs) >= 1000
    assert beside and all(text == alone for text in beside)
    assert client.completions.create(model="llama", prompt=PROMPT, max_tokens=NEW_TOKENS_LIMIT,
                                     temperature=0).choices[0].text == alone


KEEPER = {"type": "object", "additionalProperties": False, "required": ["name", "watch"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "watch": {"enum": ["dawn", "dusk"]},
                         "years": {"type": "integer", "minimum": 1, "maximum": 40}}}


def test_structured_outputs_through_the_official_client(client) -> None:
    """response_format json_schema (chat), vLLM's structured_outputs regex and choice (completions, streamed)
    on random weights: every reply is what its constraint allows, and ends."""
    for seed in range(3):
        got = client.chat.completions.create(
            model="llama", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "keeper", "schema": KEEPER, "strict": True}})
        assert got.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(got.choices[0].message.content), KEEPER)
    chunks = client.completions.create(model="llama", prompt=PROMPT, max_tokens=60, temperature=1.0, seed=7,
                                       stream=True, extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,6}-[0-9]{3}"}})
    chunks = list(chunks)
    assert re.fullmatch("[A-Z][a-z]{2,6}-[0-9]{3}", "".join(c.choices[0].text for c in chunks if c.choices))
    assert chunks[-1].choices[0].finish_reason == "stop"
    picked = client.completions.create(model="llama", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=8,
                                       extra_body={"structured_outputs": {"choice": ["port", "starboard"]}})
    assert picked.choices[0].text in ("port", "starboard")


def test_hostile_grammars_are_refused_in_bounded_time_beside_a_running_batch(server: TorchServe, client) -> None:
    """Each grammar that cannot be enforced is a 400 within the compile limit and a little, on both paths,
    while long greedy requests run beside them and end exactly as they do alone; pathological but valid
    ones are served."""
    problems: list[str] = []

    def one(job) -> None:
        path, (fields, refused) = job
        body = {"prompt": PROMPT} if path == "v1/completions" else {"messages": MESSAGES}
        started = time.monotonic()
        reply = _post(server, path, json.dumps({**body, "max_tokens": 16, "temperature": 0, **fields}).encode())
        took = time.monotonic() - started
        if reply.status != (400 if refused else 200) or took > 5:
            problems.append(f"{path} {str(fields)[:80]}: {reply.status} after {took:.1f} s {reply.body[:160]!r}")

    jobs = [(path, case) for case in hostile_grammars() for path in ("v1/completions", "v1/chat/completions")]
    with long_requests_beside(client) as (alone, beside):
        time.sleep(1)  # the long request is decoding
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, jobs))
    assert not problems, "\n".join(problems)
    assert beside and all(text == alone for text in beside)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}}}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto"],
                         ids=["required", "named", "auto"])
def test_tool_calls_through_the_official_client(client, choice) -> None:
    """A forced call always comes back as message.tool_calls whose arguments validate; streamed, the client's
    deltas (index, id and name first, then the arguments) add up to the same call."""
    asked = dict(model="llama", messages=MESSAGES, tools=[WEATHER], tool_choice=choice, max_tokens=120,
                 temperature=1.0, seed=2)
    got = client.chat.completions.create(**asked).choices[0]
    if choice != "auto" or got.finish_reason == "tool_calls":
        assert got.finish_reason == "tool_calls" and got.message.content is None
        (call,) = got.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**asked, stream=True) if c.choices]
    calls = [d for delta in deltas for d in (delta.tool_calls or [])]
    if got.finish_reason == "tool_calls":
        assert calls[0].id and calls[0].function.name == "get_weather"
        assert "".join(d.function.arguments or "" for d in calls) == got.message.tool_calls[0].function.arguments
    else:
        assert not calls and "".join(d.content or "" for d in deltas) == got.message.content


def test_n_choices_through_the_official_client(client) -> None:
    got = client.chat.completions.create(model="llama", messages=MESSAGES, n=3, max_tokens=8, temperature=1.0, seed=4)
    assert [c.index for c in got.choices] == [0, 1, 2]
    alone = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=5)
    assert got.choices[1].message.content == alone.choices[0].message.content
    assert got.usage.prompt_tokens == alone.usage.prompt_tokens


FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_through_the_official_client(server: TorchServe, client) -> None:
    """The client validates every reply and event strictly: plain, streamed (the deltas add up, sequence
    numbers increase), a JSON schema, a forced function call and its round trip; greedy, the Responses API
    and chat completions give the same reply to the same conversation."""
    base_url = f"http://127.0.0.1:{server.inference_port}/predictions/llama/1.0/v1"
    with openai.OpenAI(base_url=base_url, api_key=server.keys()["inference"], max_retries=0, timeout=120,
                       _strict_response_validation=True) as strict:
        asked = dict(model="llama", instructions="Be brief.", input="Hi there ✓", max_output_tokens=MAX_NEW,
                     temperature=0)
        got = strict.responses.create(**asked)
        chat = client.chat.completions.create(model="llama", messages=MESSAGES, max_completion_tokens=MAX_NEW,
                                              temperature=0)
        assert got.output_text == chat.choices[0].message.content and got.usage.input_tokens == chat.usage.prompt_tokens
        assert got.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
        events = list(strict.responses.create(**asked, stream=True))
        numbers = [e.sequence_number for e in events]
        assert numbers == sorted(set(numbers)) and events[0].type == "response.created"
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == got.output_text
        assert events[-1].type == f"response.{got.status}" and events[-1].response.output_text == got.output_text
        shaped = strict.responses.create(model="llama", input="Who keeps the light?", max_output_tokens=120,
                                         temperature=1.0, extra_body={"seed": 0}, text={"format": {
                                             "type": "json_schema", "name": "keeper", "schema": KEEPER, "strict": True}})
        jsonschema.validate(json.loads(shaped.output_text), KEEPER)
        called = strict.responses.create(model="llama", input="Weather in Oslo?", tools=[FLAT_WEATHER],
                                         tool_choice="required", parallel_tool_calls=False, max_output_tokens=120,
                                         temperature=1.0, extra_body={"seed": 2})
        (call,) = called.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
        answer = strict.responses.create(model="llama", tools=[FLAT_WEATHER], max_output_tokens=8, temperature=0,
                                         tool_choice="none", input=[
                                             {"role": "user", "content": "Weather in Oslo?"}, call.model_dump(),
                                             {"type": "function_call_output", "call_id": call.call_id,
                                              "output": "Sunny"}])
        assert answer.output[0].type == "message" and answer.usage.input_tokens > called.usage.input_tokens
        with pytest.raises(openai.BadRequestError) as info:
            strict.responses.create(model="llama", input="hi", previous_response_id="resp_x")
        assert info.value.body["param"] == "previous_response_id"


def test_tokenizer_endpoints_where_lm_eval_looks_for_them(server: TorchServe, tokenizer) -> None:
    """lm-evaluation-harness's remote tokenizer probes tokenizer_info and tokenize at the base URL without
    /v1/completions, reads eos_token and finds its id with tokenize; every call needs the key."""
    root = "/predictions/llama/1.0"
    info = server.request("GET", f"{root}/tokenizer_info")
    assert info.status == 200, info.body
    eos = info.json()["eos_token"]
    encoded = _post(server, "tokenize", json.dumps({"prompt": eos, "add_special_tokens": False}).encode()).json()
    assert encoded["tokens"] == [tokenizer.eos_id]
    ids = _post(server, "tokenize", json.dumps({"prompt": PROMPT}).encode()).json()["tokens"]
    assert ids == tokenizer.encode(PROMPT, bos=True)
    assert _post(server, "detokenize", json.dumps({"tokens": ids}).encode()).json() == {
        "prompt": tokenizer.decode(ids)}
    for method, path in (("GET", "tokenizer_info"), ("POST", "tokenize")):
        refused = server.request(method, f"{root}/{path}", b'{"prompt": "x"}', key=None)
        assert 400 <= refused.status < 500 and b"eos_token" not in refused.body and b'"tokens": [' not in refused.body


def test_an_agents_sdk_agent_calls_its_tool_and_answers(server: TorchServe) -> None:
    """The OpenAI Agents SDK (tracing off) runs an agent with one function tool against the server, the
    call forced so random weights make it; the run ends with the tool's result as the final output."""
    import agents  # openai-agents, pinned in requirements-test.txt

    agents.set_tracing_disabled(True)
    base_url = f"http://127.0.0.1:{server.inference_port}/predictions/llama/1.0/v1"
    calls = []

    async def get_weather(_context, arguments: str) -> str:
        calls.append(json.loads(arguments)["city"])
        return f"Sunny in {calls[-1]}"

    # WEATHER's schema bounds the city's length, so a random model's call always closes within max_tokens.
    tool = agents.FunctionTool(name="get_weather", description="The weather in a city now", on_invoke_tool=get_weather,
                               params_json_schema=WEATHER["function"]["parameters"], strict_json_schema=False)
    model = agents.OpenAIResponsesModel("llama", openai.AsyncOpenAI(base_url=base_url, api_key=server.keys()[
        "inference"], max_retries=0, timeout=120))
    agent = agents.Agent(name="weather", instructions="Use the tool.", model=model, tools=[tool],
                         tool_use_behavior="stop_on_first_tool", model_settings=agents.ModelSettings(
                             tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=1.0,
                             extra_body={"seed": 1}))
    result = agents.Runner.run_sync(agent, "Weather in Oslo?", max_turns=2)
    assert len(calls) == 1 and result.final_output == f"Sunny in {calls[0]}"


LM_EVAL_TASK = """task: lighthouse_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_scores_a_task_with_the_servers_tokenizer(server: TorchServe, checkpoint: Path, tokenizer, tmp_path,
                                                          monkeypatch) -> None:
    """lm-evaluation-harness 0.4.13's local-completions, its tokenizer backend left to probe the server (a
    Meta checkpoint has no Hugging Face tokenizer folder to give it), scores a multiple-choice task from
    a local file; each choice's log-likelihood is the float64 reference's for the token ids it sent."""
    import lm_eval  # pinned in requirements-test.txt
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    docs = [{"question": "The keeper lit the lamp at", "choices": [" dusk", " dawn", " noon"], "answer": 0},
            {"question": "Grüße aus Köln:", "choices": [" the quick brown fox", " a lighthouse"], "answer": 1}]
    data = tmp_path / "lighthouse.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (tmp_path / "lighthouse.yaml").write_text(LM_EVAL_TASK.format(data=data))
    key = server.keys()["inference"]
    monkeypatch.setenv("OPENAI_API_KEY", key)  # local-completions sends it as the bearer token
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file: no hub lookups
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{server.inference_port}/predictions/llama/1.0/v1/completions",
                             model="llama", auth_token=key, max_length=MAX_SEQ_LEN, max_retries=1)
    assert lm.tokenizer_backend == "remote"
    out = lm_eval.simple_evaluate(model=lm, tasks=["lighthouse_choices"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    samples = out["samples"]["lighthouse_choices"]
    assert len(samples) == len(docs) and "acc,none" in out["results"]["lighthouse_choices"]
    for sample in samples:
        assert len(sample["arguments"]) == len(docs[sample["doc_id"]]["choices"])
        for (context, continuation), ((loglikelihood, _greedy),) in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = context_ids + continuation_ids
            assert tokenizer.decode(ids) == context + continuation  # lm-eval adds no BOS unless asked
            want = reference_logprobs(checkpoint, tokenizer, ids)
            at = len(context_ids) - 1
            assert loglikelihood == pytest.approx(
                sum(float(want[at + j, token]) for j, token in enumerate(continuation_ids)), abs=1e-3)
