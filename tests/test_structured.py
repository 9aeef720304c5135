"""Structured outputs: on random weights (nonsense, which is where a constraint must hold) every constrained
reply validates, ends, and the requests around it are unaffected.

Schemas are checked with the `jsonschema` library, regexes with Python's `re`, grammars with their own
plain parsers here; none of them is the code under test (llguidance).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from tests.support.schemas import SCHEMAS
from tests.test_handler_unit import final_json, new_handler, run_to_end, serve
from tp_llama.config import EngineConfig
from tp_llama.engine.constraint import grammar_tokenizer
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.serving.grammars import COMPILE_LIMIT_S, GrammarCompiler
from tp_llama.serving.request import GrammarSpec, RequestError
from tp_llama.serving.settings import HandlerSettings
from tp_llama.serving.structured import grammar_spec

MAX_NEW = 160
PROMPT = "Describe the lighthouse keeper as JSON:"

SEEDS = range(6)


@pytest.fixture(scope="module")
def ckpt(synthetic_checkpoint) -> Path:
    return synthetic_checkpoint("llama3", mp=1)


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> Engine:
    return Engine.load(EngineConfig(str(ckpt), "tp", "float32", max_seq_len=256, max_batch_size=8,
                                    prefill_budget=64))


@pytest.fixture(scope="module")
def compiler(engine: Engine) -> GrammarCompiler:
    return GrammarCompiler(grammar_tokenizer(engine.tokenizer))


def constrained(engine: Engine, compiler: GrammarCompiler, spec: GrammarSpec | None, seed: int | None,
                name: str = "s", max_new: int = MAX_NEW, **params) -> Sequence:
    seq = Sequence(name, engine.tokenizer.encode(PROMPT, bos=True),
                   SamplingParams(max_new, temperature=0.0 if seed is None else 1.0, seed=seed, **params))
    seq.constraint = compiler.compile_now(spec) if spec is not None else None
    return seq


def text_of(engine: Engine, seq: Sequence) -> str:
    return engine.tokenizer.decode(seq.output)


def test_every_reply_to_a_bounded_schema_ends_and_validates(engine, compiler):
    seqs = [constrained(engine, compiler, GrammarSpec("json", json.dumps(schema), "response_format"), seed,
                        f"{i}-{seed}") for i, schema in enumerate(SCHEMAS) for seed in SEEDS]
    for start in range(0, len(seqs), 8):
        engine.generate(seqs[start : start + 8])
    for seq in seqs:
        schema = SCHEMAS[int(seq.id.split("-")[0])]
        text = text_of(engine, seq)
        assert seq.finish_reason == "stop", (seq.id, text)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_regex_choice_and_grammar_replies_match(engine, compiler):
    cases = [
        (GrammarSpec("regex", r"(lamp|lens)-[0-9]{2,4}( ok)?", "structured_outputs"),
         lambda t: re.fullmatch(r"(lamp|lens)-[0-9]{2,4}( ok)?", t)),
        (GrammarSpec("choice", json.dumps(["north", "south", "east wind"]), "structured_outputs"),
         lambda t: t in ("north", "south", "east wind")),
        (GrammarSpec("grammar", 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-z] [a-z]? | [0-9]', "structured_outputs"),
         lambda t: re.fullmatch(r"\((?:[a-z][a-z]?|[0-9])(?:,(?:[a-z][a-z]?|[0-9])){0,3}\)", t)),
        (GrammarSpec("grammar", 'start: "ship " NUM (" and " NUM)?\nNUM: /[1-9][0-9]?/', "structured_outputs"),
         lambda t: re.fullmatch(r"ship [1-9][0-9]?( and [1-9][0-9]?)?", t)),
    ]
    seqs = [constrained(engine, compiler, spec, seed, f"{i}-{seed}") for i, (spec, _) in enumerate(cases)
            for seed in range(4)]
    engine.generate(seqs)
    for seq in seqs:
        text = text_of(engine, seq)
        assert seq.finish_reason == "stop" and cases[int(seq.id.split("-")[0])][1](text), (seq.id, text)


def test_constrained_and_free_rows_batched_with_preemption_each_get_their_own_output(ckpt, engine, compiler):
    """The same requests alone in a roomy pool and together in a pool so small that sequences are
    preempted and recomputed: each sequence's tokens are the same (the matcher follows its tokens)."""
    specs = [GrammarSpec("json", json.dumps(SCHEMAS[1]), "response_format"), None,
             GrammarSpec("regex", r"[a-z]{3,9}( [a-z]{3,9}){2,5}", "structured_outputs"), None]

    def make() -> list[Sequence]:
        return [constrained(engine, compiler, spec, seed=11 + i, name=f"r{i}", max_new=60)
                for i, spec in enumerate(specs)]

    alone = []
    for seq in make():
        engine.generate([seq])
        alone.append(seq.output)
    cache = engine.cache
    block_bytes = 2 * len(engine.model.layers) * cache.k[:, : cache.block_size].numel() * cache.k.element_size()
    blocks = 128 // cache.block_size + 2  # one sequence of max_seq_len and a little more: four outgrow it
    tight = Engine.load(EngineConfig(str(ckpt), "tp", "float32", max_seq_len=128, max_batch_size=4,
                                     prefill_budget=64, kv_cache_memory_gb=blocks * block_bytes / 2**30))
    together = make()
    scheduler = tight.new_scheduler()
    for seq in together:
        scheduler.add(seq)
    tight.run(scheduler)
    assert [seq.output for seq in together] == alone
    assert scheduler.preemptions > 0


def test_logprobs_under_a_grammar_are_the_raw_models(engine, compiler):
    """Documented: log-probabilities are the model's own distribution, before the grammar's mask. So the
    first token's alternatives are those of the same request unconstrained, though the token picked is
    the grammar's."""
    spec = GrammarSpec("choice", json.dumps(["zzzz"]), "structured_outputs")
    free = constrained(engine, compiler, None, None, "free", max_new=1, logprobs=5)
    held = constrained(engine, compiler, spec, None, "held", max_new=4, logprobs=5)
    engine.generate([free, held])
    assert held.logprobs[0].top == free.logprobs[0].top
    assert held.output[0] != free.output[0] and text_of(engine, held) == "zzzz"
    assert held.logprobs[0].logprob < held.logprobs[0].top[0][1]


HOSTILE = [
    ("json", json.dumps({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)a"}}}),
     "/properties/a"),
    ("json", json.dumps({"type": "object", "properties": {"list": {"type": "array", "uniqueItems": True}}}),
     "uniqueItems"),
    ("json", json.dumps({"type": "object", "properties": {"d": {"type": "string", "format": "bogus"}}}),
     "/properties/d"),
    ("json", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing"),
    ("json", json.dumps({"if": {"type": "string"}, "then": {"maxLength": 2}}), "if"),
    ("regex", "(a", "unclosed"),
    ("regex", "(?<=a)b", "look"),
    ("grammar", "root ::= undefined_rule", "undefined_rule"),
    ("grammar", 'start: "a" | ', None),
    ("grammar", "start: x\nx: x", "matches no reply"),
]


@pytest.mark.parametrize("kind,text,named", HOSTILE)
def test_a_grammar_that_cannot_be_enforced_is_refused_naming_why(compiler, kind, text, named):
    started = time.perf_counter()
    try:
        compiler.compile_now(GrammarSpec(kind, text, "structured_outputs"))
    except RequestError as exc:
        assert exc.status == 400 and exc.param == "structured_outputs"
        if named:
            assert named in str(exc), str(exc)
    else:
        assert named is None, f"{text!r} was accepted"
    assert time.perf_counter() - started < COMPILE_LIMIT_S + 1.0


def test_a_grammar_too_slow_to_compile_is_refused_at_the_time_limit(compiler, monkeypatch):
    real = GrammarCompiler._compile

    def slow(self, spec, grammar):
        time.sleep(COMPILE_LIMIT_S + 3)
        return real(self, spec, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    started = time.perf_counter()
    with pytest.raises(RequestError, match="did not compile within"):
        compiler.compile_now(GrammarSpec("regex", "slow-[a-z]{3}", "structured_outputs"))
    assert time.perf_counter() - started < COMPILE_LIMIT_S + 1.0


def test_deep_nesting_and_huge_enums_are_refused_or_compiled_within_the_limit(compiler):
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    for schema in (deep, {"enum": [f"value-{i}" for i in range(100_000)]}):
        started = time.perf_counter()
        try:
            compiler.compile_now(GrammarSpec("json", json.dumps(schema), "response_format"))
        except RequestError as exc:
            assert exc.status == 400
        assert time.perf_counter() - started < COMPILE_LIMIT_S + 1.0


@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "json_schema"}}, "json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": {"a": 1}}}, "response_format.type"),  # unhashable: a TypeError, the handler's 500
    ({"response_format": {"type": ["text"]}}, "response_format.type"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "unknown field"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"choice": []}}, "non-empty array"),
    ({"structured_outputs": {"structural_tag": "x"}}, "unsupported field"),
    ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
    # Read with json.loads, which raised a RecursionError or a bare ValueError (the handler's own 500) for these.
    ({"structured_outputs": {"json": "[" * 5000 + "]" * 5000}}, "structured_outputs.json is nested too deeply"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '{"maximum": 1' + "0" * 5000
                                                                 + "}"}}},
     "response_format.json_schema.schema holds a number too long to read"),
    ({"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}}, "only one"),
])
def test_malformed_structured_fields_are_refused(body, message):
    with pytest.raises(RequestError, match=message):
        grammar_spec(body)


def test_text_response_format_is_no_constraint_and_strict_is_accepted_either_way():
    assert grammar_spec({"response_format": {"type": "text"}}) is None
    for strict in (True, False, None):
        spec = grammar_spec({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": strict, "schema": {"type": "object"}}}})
        assert spec.kind == "json" and json.loads(spec.text) == {"type": "object"}


# Through the handler, driven call by call as TorchServe drives it.

SETTINGS = HandlerSettings(EngineConfig("/ckpt", max_seq_len=256), default_max_new_tokens=64, max_new_tokens_limit=200,
                           temperature=1.0, top_p=1.0)


@pytest.fixture
def handler(engine, compiler):
    return new_handler(engine, SETTINGS, compiler)


def chat(extra: dict, stream: bool = False) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "the keeper?"}], "max_tokens": MAX_NEW,
                       "seed": 3, "stream": stream, **extra}).encode()


def test_both_apis_answer_with_constrained_replies_and_refuse_bad_grammars_in_the_first_call(handler):
    schema = SCHEMAS[0]
    requests = {
        "oa": chat({"response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}}),
        "oa-stream": chat({"structured_outputs": {"json": schema}}, stream=True),
        "native": json.dumps({"prompt": PROMPT, "max_new_tokens": MAX_NEW, "seed": 4,
                              "structured_outputs": {"choice": ["yes", "no"]}}).encode(),
        "bad": chat({"response_format": {"type": "json_schema", "json_schema": {
            "name": "k", "schema": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3,
                                                                           "not": {"const": 6}}}}}}}),
        "free": chat({}),
    }
    paths = {rid: "v1/chat/completions" for rid in requests if rid != "native"}
    replies = run_to_end(handler, requests, paths=paths)
    first = replies["bad"][0]
    assert len(replies["bad"]) == 1 and first[1].status[first[2]] == 400
    error = json.loads(first[0])["error"]
    assert error["param"] == "response_format" and "/properties/n" in error["message"]
    reply = final_json(replies["oa"])["choices"][0]
    assert reply["finish_reason"] == "stop"
    jsonschema.validate(json.loads(reply["message"]["content"]), schema)
    chunks = [json.loads(line[6:]) for piece, _, _ in replies["oa-stream"] for line in piece.splitlines()
              if line.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(streamed), schema)
    assert final_json(replies["native"])["text"] in ("yes", "no")
    assert final_json(replies["free"])["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_stop_string_ends_a_constrained_reply_where_it_appears(handler):
    body = chat({"structured_outputs": {"regex": "abc-[0-9]{1,3}-xyz"}, "stop": ["-"]})
    reply = final_json(run_to_end(handler, {"r": body}, paths={"r": "v1/chat/completions"})["r"])["choices"][0]
    assert (reply["finish_reason"], reply["message"]["content"]) == ("stop", "abc")


def test_ignore_eos_beside_a_grammar_is_refused(handler):
    body = chat({"structured_outputs": {"regex": "a+"}, "ignore_eos": True})
    got = serve(handler, [[("r", body)]], {"r": "v1/chat/completions"})["r"][0]
    assert got[1].status[got[2]] == 400 and "ignore_eos" in got[0]


def test_a_slow_grammar_does_not_stall_the_batch(handler, compiler, monkeypatch):
    """While a grammar compiles the running sequences keep stepping, and the call that waits for it ends
    as soon as it is settled (here a compile made slow on purpose)."""
    import tp_llama.serving.grammars as grammars

    real = GrammarCompiler._compile

    def slow(self, spec, grammar):
        time.sleep(0.4)
        return real(self, spec, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    long = json.dumps({"prompt": PROMPT, "max_new_tokens": 150, "temperature": 0, "ignore_eos": True}).encode()
    serve(handler, [[("long", long)]])
    steps_before = handler.engine.stats.decode_tokens
    started = time.perf_counter()
    fresh = chat({"structured_outputs": {"regex": "slow-[0-9]{2}"}})
    got = serve(handler, [[("long", None), ("new", fresh)]], {"new": "v1/chat/completions"})
    took = time.perf_counter() - started
    assert handler.engine.stats.decode_tokens > steps_before  # the long request decoded meanwhile
    assert 0.4 <= took < grammars.COMPILE_LIMIT_S + 1.0  # the limit, a step and some room on a busy CI machine
    assert got["new"][0][1].status.get(got["new"][0][2]) is None  # admitted, not refused
    replies = run_to_end(handler, {"long": None, "new": None}, paths={"new": "v1/chat/completions"})
    assert re.fullmatch("slow-[0-9]{2}", final_json(replies["new"])["choices"][0]["message"]["content"])


def test_a_grammar_that_waited_behind_slow_ones_is_a_503_and_the_slow_ones_are_the_400s(engine, monkeypatch):
    """Both compile workers busy past the limit with slow grammars: a grammar queued behind them in the same call had
    no time of its own, and was refused as too slow to compile, a 400 blaming a request that did nothing wrong."""
    real = GrammarCompiler._compile

    def slow(self, spec, grammar):
        if spec.text.startswith("slow"):
            time.sleep(COMPILE_LIMIT_S + 0.5)
        return real(self, spec, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    handler = new_handler(engine, SETTINGS, GrammarCompiler(grammar_tokenizer(engine.tokenizer)))  # 2 idle workers
    requests = {rid: chat({"structured_outputs": {"regex": f"{rid}-[a-z]{{2}}"}}) for rid in ("slow0", "slow1", "queued")}
    got = serve(handler, [list(requests.items())], {rid: "v1/chat/completions" for rid in requests})
    status = {rid: got[rid][0][1].status.get(got[rid][0][2]) for rid in requests}
    assert status == {"slow0": 400, "slow1": 400, "queued": 503}, status
    assert "busy with other requests' grammars" in json.loads(got["queued"][0][0])["error"]["message"]


def test_a_grammar_compile_that_raises_fails_its_request_alone(engine, monkeypatch):
    """An exception of llguidance's own while compiling (not a refusal of the grammar) is that request's 500; the
    requests beside it in the call are served (it escaped the call, and every request in it got a 500)."""
    real = GrammarCompiler._compile

    def broken(self, spec, grammar):
        if spec.text.startswith("broken"):
            raise ValueError("the compiler broke")
        return real(self, spec, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", broken)
    handler = new_handler(engine, SETTINGS, GrammarCompiler(grammar_tokenizer(engine.tokenizer)))
    requests = {rid: chat({"structured_outputs": {"regex": f"{rid}-[a-z]{{2}}"}}) for rid in ("broken", "fine")}
    requests["plain"] = chat({})
    replies = run_to_end(handler, requests, paths={rid: "v1/chat/completions" for rid in requests})
    message = json.loads(replies["broken"][0][0])["error"]["message"]
    assert "compiling the grammar failed (ValueError: the compiler broke)" in message
    assert replies["broken"][0][1].status.get(replies["broken"][0][2]) == 500
    assert re.fullmatch("fine-[a-z]{2}", final_json(replies["fine"])["choices"][0]["message"]["content"])
    assert final_json(replies["plain"])["choices"][0]["message"]["content"]


def test_a_request_past_response_timeout_while_its_grammar_compiles_ends_without_a_step(handler, monkeypatch):
    """A request whose responseTimeout passes before its grammar is compiled (here a timeout of 0, shorter than
    the call's admissions) answers the timeout and leaves nothing behind: its ended sequences once joined the
    queue when the grammar was ready, and one stayed there for good, stepped on every call."""
    real = GrammarCompiler._compile

    def slow(self, spec, grammar):
        time.sleep(0.2)
        return real(self, spec, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    handler.response_timeout_s = 0.0
    body = json.dumps({"prompt": PROMPT, "max_new_tokens": 8, "structured_outputs": {"regex": "late-[0-9]{2}"}})
    reply = final_json(run_to_end(handler, {"r": body.encode()})["r"])
    assert reply["finish_reason"] == "timeout" and reply["usage"]["completion_tokens"] == 0
    serve(handler, [[]])
    assert not handler.scheduler.has_work() and not handler.live and handler.scheduler.pool.used == 0


def test_mask_bits_match_the_grammar_for_the_real_llama3_vocabulary(real_tokenizer_compiler):
    """The whole 128,256-token vocabulary: after '{"a": ' only tokens that continue a JSON integer or
    start it are allowed, and the stop tokens only once the object can close."""
    tokenizer, compiler = real_tokenizer_compiler
    spec = GrammarSpec("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a"], "additionalProperties": False}), "response_format")
    constraint = compiler.compile_now(spec)
    assert constraint.advance(tokenizer.encode('{"a": ', bos=False))
    from tp_llama.engine.constraint import Masks

    bits = Masks().start({0: (constraint, [])}, tokenizer.n_words).result().bits
    allowed = ((bits[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: tokenizer.n_words]
    pieces = tokenizer.token_bytes()
    for token in allowed.nonzero().flatten().tolist():
        assert re.fullmatch(rb"-?[0-9]+|-", pieces[token]), pieces[token]
    assert not any(allowed[t] for t in tokenizer.stop_ids)
    assert allowed[tokenizer.encode("7", bos=False)[0]] and allowed[tokenizer.encode("-", bos=False)[0]]
