"""A grammar's forced tokens, taken several a step without a draw: the replies, their log-probabilities
and their seeded draws are those of the same requests picked a token a step (forced tokens switched
off), alone and beside speculative decoding's proposals, which the grammar cuts before verification.

The reference runs are the step-by-step path (`Constraint.forced` returning nothing), which
tests/test_structured.py checks against jsonschema and plain parsers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from tests.support.proposals import Scripted
from tests.support.schemas import SCHEMAS
from tp_llama.config import EngineConfig
from tp_llama.engine.constraint import Constraint, Masks, grammar_tokenizer
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.serving.grammars import GrammarCompiler
from tp_llama.serving.request import GrammarSpec

PROMPT = "Describe the lighthouse keeper as JSON:"
# Long property names and a fixed array length: most of a reply is forced.
LONG_KEYS = {"type": "object", "additionalProperties": False, "required": ["keeper_name", "years_of_service", "lamps"],
             "properties": {"keeper_name": {"type": "string", "maxLength": 5},
                            "years_of_service": {"type": "integer", "minimum": 0, "maximum": 99},
                            "lamps": {"type": "array", "minItems": 3, "maxItems": 3,
                                      "items": {"enum": ["north_lamp", "south_lamp"]}}}}
# Repeated enum values: n-gram lookup proposes from the reply's own earlier items.
REPEATS = {"type": "array", "minItems": 8, "maxItems": 8, "items": {"enum": ["lighthouse keeper", "harbour"]}}


@pytest.fixture(scope="module")
def ckpt(synthetic_checkpoint) -> Path:
    return synthetic_checkpoint("llama3", mp=1)


def load(ckpt: Path, speculative: str = "off") -> Engine:
    return Engine.load(EngineConfig(str(ckpt), "tp", "float32", max_seq_len=256, max_batch_size=8, prefill_budget=64,
                                    speculative=speculative,
                                    draft_ckpt_dir=str(ckpt) if speculative == "draft" else None))


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> Engine:
    return load(ckpt)


@pytest.fixture(scope="module")
def compiler(engine: Engine) -> GrammarCompiler:
    return GrammarCompiler(grammar_tokenizer(engine.tokenizer))


def requests(engine: Engine, compiler: GrammarCompiler, schemas: list[dict]) -> list[Sequence]:
    """One greedy and one seeded request per schema, and a free one beside them, with log-probabilities."""
    out = []
    for i, schema in enumerate(schemas):
        for seed in (None, 40 + i):
            seq = Sequence(f"s{i}-{seed}", engine.tokenizer.encode(PROMPT, bos=True),
                           SamplingParams(160, temperature=0.0 if seed is None else 1.0, seed=seed, logprobs=3))
            seq.constraint = compiler.compile_now(GrammarSpec("json", json.dumps(schema), "response_format"))
            out.append(seq)
    out.append(Sequence("free", engine.tokenizer.encode(PROMPT, bos=True), SamplingParams(40, temperature=1.0, seed=7,
                                                                                         logprobs=3)))
    return out


def step_by_step(engine: Engine, compiler: GrammarCompiler, schemas: list[dict], monkeypatch) -> list[Sequence]:
    with monkeypatch.context() as patch:
        patch.setattr(Constraint, "forced", lambda self, most: [])
        return engine.generate(requests(engine, compiler, schemas))


def assert_same_replies(fast: list[Sequence], slow: list[Sequence]) -> None:
    for a, b in zip(fast, slow):
        assert a.output == b.output, a.id
        assert a.finish_reason == b.finish_reason == ("stop" if a.constraint else "length"), a.id
        assert [lp.token for lp in a.logprobs] == a.output
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_forced_tokens_are_taken_several_a_step_and_change_no_reply(engine, compiler, monkeypatch):
    schemas = [LONG_KEYS, *SCHEMAS[:3]]
    slow = step_by_step(engine, compiler, schemas, monkeypatch)
    forced_before = engine.stats.forced
    steps_before = engine.stats.decode_tokens
    fast = engine.generate(requests(engine, compiler, schemas))
    assert_same_replies(fast, slow)
    for seq, schema in zip(fast, [s for s in schemas for _ in range(2)]):
        jsonschema.validate(json.loads(engine.tokenizer.decode(seq.output)), schema)
    forced = engine.stats.forced - forced_before
    emitted = sum(len(seq.output) for seq in fast if seq.constraint)
    assert forced > emitted // 3, (forced, emitted)  # most of LONG_KEYS's reply is forced
    assert engine.stats.decode_tokens - steps_before < sum(len(seq.output) for seq in slow)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_proposals_under_a_grammar_follow_its_forced_tokens_and_change_no_reply(ckpt, engine, compiler, monkeypatch,
                                                                                 proposer):
    """n-gram lookup, and a draft model (this checkpoint as a second one: it proposes what greedy rows
    pick) fed the forced tokens before it drafts."""
    slow = step_by_step(engine, compiler, [REPEATS, LONG_KEYS], monkeypatch)
    speculating = load(ckpt, proposer)
    scheduler = speculating.new_scheduler()
    scheduler.speculator.counts.choose = lambda rows: scheduler.speculator.tokens  # every step proposes
    fast = requests(speculating, compiler, [REPEATS, LONG_KEYS])
    for seq in fast:
        scheduler.add(seq)
    drafted_after_forced = []
    if proposer == "draft":  # watched: how often the draft drafted past a row's forced tokens
        propose = scheduler.speculator.draft.propose
        scheduler.speculator.draft.propose = lambda seqs, rooms, after: (
            drafted_after_forced.extend(r for r, a in zip(rooms, after) if r and a) or propose(seqs, rooms, after))
    speculating.run(scheduler)
    assert_same_replies(fast, slow)
    assert speculating.stats.accepted > 0 and speculating.stats.forced > 0
    assert proposer == "ngram" or drafted_after_forced


class Ahead(Scripted):
    """Proposes each named sequence's own reply after its tokens (`replies`: its prompt's length, its reply and
    the most proposals a step, by id), so every proposal is taken."""

    def __init__(self, replies: dict[str, tuple[int, list[int], int]]):
        super().__init__()
        self.replies = replies

    def propose(self, seq_id: str, tokens, most: int) -> list[int]:
        prompt, reply, cap = self.replies[seq_id]
        return reply[len(tokens) - prompt :][: min(most, cap)]


def test_a_free_rows_run_of_taken_proposals_passes_the_masks_of_the_constrained_rows_beside_it(engine, compiler):
    """A free row verifying a position past every mask of its step: a constrained row beside it takes forced
    tokens and one proposal after them (two masks: before and after the proposal) while the free row's run is
    longer. Each row draws under its own masks or none, and the replies are those of each alone."""
    prompt = engine.tokenizer.encode(PROMPT, bos=True)

    def pair() -> list[Sequence]:
        schema = Sequence("schema", prompt, SamplingParams(160))
        schema.constraint = compiler.compile_now(GrammarSpec("json", json.dumps(LONG_KEYS), "response_format"))
        return [schema, Sequence("free", prompt, SamplingParams(40, ignore_eos=True))]

    alone = [engine.generate([seq])[0].output for seq in pair()]
    scheduler = engine.new_scheduler()
    scheduler.speculator = Ahead({"schema": (len(prompt), alone[0], 1), "free": (len(prompt), alone[1], 40)})
    together = pair()
    for seq in together:
        scheduler.add(seq)
    engine.run(scheduler)
    assert [seq.output for seq in together] == alone
    assert scheduler.speculator.accepted_at[3] > 0 and engine.stats.forced > 0


def allowed(masks: Masks, constraint: Constraint, n_words: int) -> list[int]:
    bits = masks.start({0: (constraint, [])}, n_words).result().bits[0].tolist()
    return [w * 32 + b for w, word in enumerate(bits) for b in range(32) if word >> b & 1]


def test_every_forced_token_is_the_only_one_its_mask_allows(real_tokenizer_compiler):
    """What taking forced tokens without a draw rests on: at each of them llguidance's mask, computed
    independently of compute_ff_tokens, allows that token alone (random walks of the schema corpus over
    Meta's 128,256-token vocabulary)."""
    tokenizer, compiler = real_tokenizer_compiler
    masks, rng, checked = Masks(), random.Random(0), 0
    for schema in [LONG_KEYS, *SCHEMAS]:
        constraint = compiler.compile_now(GrammarSpec("json", json.dumps(schema), "response_format"))
        for _ in range(40):
            for token in constraint.forced(64):
                assert allowed(masks, constraint, tokenizer.n_words) == [token], (schema, tokenizer.decode([token]))
                assert constraint.advance([token])
                checked += 1
            token = rng.choice(allowed(masks, constraint, tokenizer.n_words))
            if token in tokenizer.stop_ids:
                break
            assert constraint.advance([token])
    assert checked > 50
