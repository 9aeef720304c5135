"""Engine.step, one step at a time by hand (tp mode, float32, a synthetic checkpoint): each step returns exactly
the sequences it moved (a prompt chunk computed, tokens made), a finished sequence is never returned again, and
the tokens stepped by hand are those Engine.generate's loop makes."""

from __future__ import annotations

from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence

PROMPTS = ["the keeper climbed the stairs", "a lamp", "the log at dusk held the reading of the glass"]


def sequences(engine: Engine) -> list[Sequence]:
    """Three prompts, greedy, each stopping after its own number of tokens."""
    return [Sequence(f"s{i}", engine.tokenizer.encode(p, bos=True), SamplingParams(2 + 3 * i, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]


def test_each_step_returns_the_sequences_it_moved(synthetic_checkpoint):
    engine = Engine.load(EngineConfig(str(synthetic_checkpoint("llama3")), "tp", "float32", max_seq_len=64,
                                      max_batch_size=4, prefill_budget=16))
    scheduler = engine.new_scheduler()
    assert engine.step(scheduler) == []  # nothing to do: a step of no rows
    seqs = sequences(engine)
    for seq in seqs:
        scheduler.add(seq)

    def state() -> dict[str, tuple[int, int]]:
        return {seq.id: (seq.computed, len(seq.output)) for seq in seqs}

    seen = state()
    finished: set[str] = set()
    steps, chunks = 0, 0
    while scheduler.has_work():
        touched = engine.step(scheduler)
        now = state()
        moved = {i for i in now if now[i] != seen[i]}
        assert {seq.id for seq in touched} == moved and not moved & finished
        seen = now
        finished |= {seq.id for seq in touched if seq.finished}
        chunks += any(seq.output == [] for seq in touched)
        steps += 1
        assert steps < 100
    assert chunks and finished == set(seen) and [len(seq.output) for seq in seqs] == [2, 5, 8]
    assert [seq.output for seq in seqs] == [seq.output for seq in engine.generate(sequences(engine))]
