"""n > 1 on both APIs: n replies to one prompt, prefilled once, each with its own generator (seed + index),
returned as choices with their index (streamed interleaved), usage counting the prompt once."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.test_handler_unit import final_json, run_to_end, serve
from tests.test_structured import PROMPT, SCHEMAS, ckpt, compiler, engine, handler  # noqa: F401 (fixtures)
from tp_llama.serving.metrics import GENERATED_TOKENS, PROMPT_TOKENS, ServingMetrics
from tp_llama.serving.stream import StreamDecoder

COMPLETIONS = {"r": "v1/completions"}
CHAT = {"r": "v1/chat/completions"}


def events(replies: list) -> list[dict]:
    return [json.loads(line[6:]) for piece, _, _ in replies for line in piece.splitlines() if line.startswith("data: {")]


def test_n_choices_are_the_requests_of_seed_plus_index_and_the_prompt_is_prefilled_once(handler, engine):  # noqa: F811
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 40, "cache_salt": "n-test",
            "return_token_ids": True}
    before = engine.stats.prefill_tokens
    together = final_json(run_to_end(handler, {"r": json.dumps({**body, "n": 3}).encode()}, paths=COMPLETIONS)["r"])
    prefilled = engine.stats.prefill_tokens - before
    prompt_tokens = together["usage"]["prompt_tokens"]
    assert prefilled == prompt_tokens == len(engine.tokenizer.encode(PROMPT, bos=True))
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    for i, choice in enumerate(together["choices"]):
        alone = {**body, "seed": 40 + i, "cache_salt": f"alone-{i}"}
        want = final_json(run_to_end(handler, {"r": json.dumps(alone).encode()}, paths=COMPLETIONS)["r"])
        assert choice["text"] == want["choices"][0]["text"]
    assert together["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in together["choices"])


def test_streamed_chat_choices_interleave_and_each_adds_up_to_its_whole_reply(handler):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 1.0, "seed": 5,
            "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    streamed = events(run_to_end(handler, {"r": json.dumps(body).encode()}, paths=CHAT)["r"])
    whole = final_json(run_to_end(handler, {"r": json.dumps({**body, "stream": False, "stream_options": None})
                                              .encode()}, paths=CHAT)["r"])
    texts, roles, reasons = {}, {}, {}
    for event in streamed:
        for choice in event["choices"]:
            i = choice["index"]
            texts[i] = texts.get(i, "") + (choice["delta"].get("content") or "")
            roles.setdefault(i, choice["delta"].get("role"))
            reasons[i] = choice["finish_reason"] or reasons.get(i)
    assert sorted(texts) == [0, 1, 2] and set(roles.values()) == {"assistant"}
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert [reasons[i] for i in range(3)] == [c["finish_reason"] for c in whole["choices"]]
    assert streamed[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_native_n_answers_choices_and_each_validates_under_a_schema(handler):
    body = {"prompt": PROMPT, "max_new_tokens": 160, "temperature": 1.0, "seed": 9, "n": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": SCHEMAS[1]}}}
    reply = final_json(run_to_end(handler, {"r": json.dumps(body).encode()})["r"])
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    for choice in reply["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), SCHEMAS[1])
    streamed = run_to_end(handler, {"r": json.dumps({**body, "stream": True}).encode()})["r"]
    lines = [json.loads(line) for piece, _, _ in streamed for line in piece.splitlines() if line]
    texts: dict[int, str] = {}
    for line in lines[:-1]:
        texts[line["index"]] = texts.get(line["index"], "") + line["text"]
    assert [texts[i] for i in range(4)] == [c["text"] for c in reply["choices"]]
    usage = lines[-1]["usage"]  # the second request finds the prompt in the prefix cache
    assert set(lines[-1]) == {"usage"} and (usage["prompt_tokens"], usage["completion_tokens"]) == \
        (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"])


def test_an_ended_streamed_choice_is_not_followed_again_while_others_step(handler, engine, monkeypatch):  # noqa: F811
    """More prompts than may run at once: the first ones end while the rest still step. Each choice's decoder
    finishes once (finishing decodes its whole reply), and each streamed choice adds up to its unstreamed one."""
    prompts = [[1 + i, 20 + i, 40] for i in range(2 * engine.config.max_batch_size - 2)]
    body = {"prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    finished = []
    finish = StreamDecoder.finish
    monkeypatch.setattr(StreamDecoder, "finish", lambda decoder: finished.append(decoder) or finish(decoder))
    streamed = events(run_to_end(handler, {"r": json.dumps({**body, "stream": True}).encode()}, paths=COMPLETIONS)["r"])
    assert len(finished) == len(set(finished)) == len(prompts)
    whole = final_json(run_to_end(handler, {"r": json.dumps(body).encode()}, paths=COMPLETIONS)["r"])
    texts, ids = {}, {}
    for event in streamed:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            ids[choice["index"]] = ids.get(choice["index"], []) + choice["token_ids"]
    assert [(texts[c["index"]], ids[c["index"]]) for c in whole["choices"]] == \
        [(c["text"], c["token_ids"]) for c in whole["choices"]]
    assert all(len(c["token_ids"]) == 5 for c in whole["choices"]) and len(whole["choices"]) == len(prompts)


def test_the_token_counters_count_a_groups_prompt_once_as_its_usage_does(handler, engine):  # noqa: F811
    """llama_prompt_tokens_total counts the prompt tokens of the requests that ended (docs/operations.md); a
    request of n replies has one prompt, prefilled once and counted once in its usage. The counter counted it
    n times. Native and OpenAI, a whole and a streamed reply, several prompts of n each: the counters add up
    to the usage the clients got, and the prompts' lengths are their own encodings."""
    handler.metrics = ServingMetrics(None, "llama", handler.scheduler.pool.n_blocks)
    prompts = [PROMPT, "the keeper climbed the stairs"]
    ids = [engine.tokenizer.encode(p, bos=True) for p in prompts]
    sampled = {"temperature": 1.0, "seed": 11, "n": 3}
    requests = {
        "native": ({"prompt": prompts[0], "max_new_tokens": 4, **sampled}, {}),
        "streamed": ({"prompt": prompts[1], "max_new_tokens": 3, "stream": True, **sampled}, {}),
        "prompts": ({"prompt": ids, "max_tokens": 2, **sampled}, COMPLETIONS),
    }
    usages = []
    for body, paths in requests.values():
        last = run_to_end(handler, {"r": json.dumps(body).encode()}, paths=paths)["r"][-1][0]
        usages.append(json.loads(last.splitlines()[-1])["usage"])  # streamed: the last line, {"usage"}
    assert [u["prompt_tokens"] for u in usages] == [len(ids[0]), len(ids[1]), len(ids[0]) + len(ids[1])]
    totals = handler.metrics.totals
    assert totals[(PROMPT_TOKENS, "")] == sum(u["prompt_tokens"] for u in usages) == 2 * (len(ids[0]) + len(ids[1]))
    assert totals[(GENERATED_TOKENS, "")] == sum(u["completion_tokens"] for u in usages)


@pytest.mark.parametrize("body,path,message", [
    ({"prompt": "hi", "n": 0}, COMPLETIONS, "n must be in"),
    ({"prompt": "hi", "n": 99}, COMPLETIONS, "n must be in"),
    ({"prompt": "hi", "n": 2, "max_tokens": 0, "echo": True, "logprobs": 1}, COMPLETIONS, "n > 1"),
    ({"prompt": "hi", "n": 9}, {}, "exceeds the 8 that may run at once"),
])
def test_bad_n_is_refused(handler, body, path, message):
    got = serve(handler, [[("r", json.dumps(body).encode())]], path)["r"][0]
    assert got[1].status[got[2]] == 400 and message in got[0]
