"""The generation loop and sampling, driven by a scripted stand-in for the model."""

from __future__ import annotations

import pytest
import torch

from tp_llama.generation import GenerationRequest, generate, sample

VOCAB, EOS = 16, 2


class ScriptedModel(torch.nn.Module):
    """Emits script[row][k] as the k-th generated token of each row and records what it was fed."""

    def __init__(self, scripts: list[list[int]], max_seq_len: int = 64):
        super().__init__()
        self.scripts, self.max_seq_len, self.max_batch_size = scripts, max_seq_len, 8
        self.calls: list[tuple[list[list[int]], list[int], slice]] = []
        self.generated = [0] * len(scripts)

    def forward(self, tokens, start_pos, rows):
        self.calls.append((tokens.tolist(), start_pos.tolist(), rows))
        logits = torch.zeros(tokens.shape[0], VOCAB)
        for i, row in enumerate(range(rows.start, rows.stop)):
            script = self.scripts[row]
            logits[i, script[min(self.generated[row], len(script) - 1)]] = 10.0
            self.generated[row] += 1
        return logits


def run(scripts, requests):
    model = ScriptedModel(scripts)
    return model, generate(model, requests, frozenset({EOS}), torch.device("cpu"), rank=0)


def test_stops_at_eos_and_at_max_new_tokens_per_row():
    model, results = run(
        [[5, 6, EOS, 7], [8, 9, 10, 11, 12]],
        [GenerationRequest([1, 3, 4], max_new_tokens=10), GenerationRequest([1], max_new_tokens=3)],
    )
    assert results[0].token_ids == [5, 6] and results[0].finish_reason == "stop"
    assert results[1].token_ids == [8, 9, 10] and results[1].finish_reason == "length"


def test_ignore_eos_keeps_going():
    _, results = run([[5, EOS, 7, 8]], [GenerationRequest([1, 3], max_new_tokens=4, ignore_eos=True)])
    assert results[0].token_ids == [5, EOS, 7, 8] and results[0].finish_reason == "length"


def test_each_row_is_prefilled_alone_then_decoded_at_its_own_position():
    model, _ = run([[5, 6, 7], [8, 9, 10]],
                   [GenerationRequest([1, 3, 4], max_new_tokens=3), GenerationRequest([1], max_new_tokens=3)])
    prefill_a, prefill_b, *decode = model.calls
    assert prefill_a == ([[1, 3, 4]], [0], slice(0, 1))
    assert prefill_b == ([[1]], [0], slice(1, 2))
    assert decode[0] == ([[5], [8]], [3, 1], slice(0, 2))
    assert decode[1] == ([[6], [9]], [4, 2], slice(0, 2))
    assert len(decode) == 2  # the third token of each row ends generation without another forward


def test_finished_rows_stop_advancing_so_they_never_pass_max_seq_len():
    model, results = run([[EOS], [8, 9, 10, 11]],
                         [GenerationRequest([1, 3], max_new_tokens=1), GenerationRequest([1], max_new_tokens=4)])
    assert results[0].finish_reason == "stop"
    assert [call[1][0] for call in model.calls[2:]] == [2, 2, 2]


def test_requests_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        run([[5]], [GenerationRequest(list(range(60)), max_new_tokens=10)])
    with pytest.raises(ValueError, match="prompt is empty"):
        run([[5]], [GenerationRequest([], max_new_tokens=1)])


def test_greedy_is_argmax_and_tiny_top_p_is_greedy_too():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, 0.0, 1.0, None) == 1
    gen = torch.Generator().manual_seed(0)
    assert {sample(logits, 1.0, 1e-6, gen) for _ in range(50)} == {1}


def test_top_p_never_samples_outside_the_nucleus_and_seed_repeats():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(1)
    picks = [sample(logits, 1.0, 0.7, gen) for _ in range(400)]
    assert set(picks) == {0, 1}  # 0.5 + 0.3 covers 0.7; tokens 2 and 3 are outside
    assert 0.5 < picks.count(0) / len(picks) < 0.75  # renormalised 0.5/0.8 = 0.625
    again = torch.Generator().manual_seed(1)
    assert [sample(logits, 1.0, 0.7, again) for _ in range(400)] == picks
