"""The perplexity command (tp_llama.cli.perplexity) against llama.cpp's definition, computed here from the
float64 reference model (tests/support/reference.py) on the same weights.

Each chunk of CTX ids starts with BOS in place of its first id and is scored on its second half:
the log-probability of token j + 1 given tokens 0..j, for j from CTX/2 to CTX - 2. The command runs
in this process at TP 1 (the engine's prompt log-probabilities under TP 2 are checked through the
served OpenAI echo in tests/test_openai.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.support.reference import ReferenceModel
from tp_llama.cli import perplexity
from tp_llama.config import EngineConfig
from tp_llama.engine import sampling, scoring
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.tokenizer import load_tokenizer

CTX = 32
TEXT = ("The keeper climbed the stairs at dusk, lit the lamp and wrote the reading in the log. "
        "Storm from the north, the glass falling, gulls inland over the harbour. ") * 4
TOLERANCE = 2e-4  # float32 engine against float64 reference, per log-probability
NEAR_TIE = 1e-3  # a reference top-2 gap under which float32 may pick the other token


@pytest.fixture(scope="module")
def checkpoint(synthetic_checkpoint) -> Path:
    return synthetic_checkpoint("llama2")


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> ReferenceModel:
    return ReferenceModel.load(checkpoint, load_tokenizer(checkpoint / "tokenizer.model").n_words)


def expected(reference: ReferenceModel, ids: list[int], bos: int) -> tuple[list[list[float]], list[list[int]], list]:
    """llama.cpp's chunks and scored positions, from the float64 reference: per chunk the scored tokens'
    log-probabilities, the reference's top-1 ids and its top-2 gaps."""
    logprobs, top1, gaps = [], [], []
    for c in range(len(ids) // CTX):
        chunk = [bos] + ids[c * CTX + 1 : (c + 1) * CTX]
        lp = torch.log_softmax(reference.logits(chunk), dim=-1)
        positions = range(CTX // 2, CTX - 1)
        logprobs.append([float(lp[j, chunk[j + 1]]) for j in positions])
        top = lp.topk(2, dim=-1)
        top1.append([int(top.indices[j, 0]) for j in positions])
        gaps.append([float(top.values[j, 0] - top.values[j, 1]) for j in positions])
    return logprobs, top1, gaps


def run_cli(capfd, *args: str) -> tuple[int, str, str]:
    code = perplexity.main([*args])
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_vocabulary_slices_merge_into_the_whole_distribution(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What TP ranks send (each slice's log-sum-exp, target logit and top N) merges into log_softmax over
    the whole vocabulary, ids past the tokenizer's left out; equal logits in two slices keep id order."""
    if kernel == "torch":
        monkeypatch.setattr(sampling, "in_c", lambda raw: False)
    logits = torch.randn(7, 40, generator=torch.Generator().manual_seed(3))
    logits[2, [5, 25]] = 9.0
    logits[:, 36:] = 50.0  # padding rows past n_words: never in the distribution
    n_words, targets = 36, torch.tensor([0, 5, 25, 35, 17, 19, 20])
    halves = [scoring.slice_stats(logits[:, s : s + 20], s, n_words, targets, 3) for s in (0, 20)]
    logprob, ids, values = scoring.merge_stats(torch.cat(halves, dim=1), 2, 3)
    whole = scoring.merge_stats(scoring.slice_stats(logits, 0, n_words, targets, 3), 1, 3)
    want = torch.log_softmax(logits[:, :n_words].double(), dim=-1)
    top = want.topk(3, dim=-1)
    assert logprob.tolist() == pytest.approx(want[range(7), targets].tolist(), abs=1e-6)
    assert values.flatten().tolist() == pytest.approx(top.values.flatten().tolist(), abs=1e-6)
    assert ids[2, :2].tolist() == [5, 25] and torch.equal(ids[[0, 1, 3, 4, 5, 6]], top.indices[[0, 1, 3, 4, 5, 6]])
    assert torch.equal(whole[1], ids) and torch.allclose(whole[0], logprob) and torch.allclose(whole[2], values)


def test_a_preempted_echo_sequence_scores_each_prompt_token_once(checkpoint: Path, reference: ReferenceModel) -> None:
    """Two prompts scored and generating in a pool too small for both to grow a third block: the newer
    is preempted and recomputed, and still has one entry per prompt token after the first, equal to the
    reference's."""
    block_bytes = 2 * 2 * 4 * 16 * 16 * 4  # K and V, 2 layers, 4 KV heads, 16 positions of 16 floats
    engine = Engine.load(EngineConfig(str(checkpoint), dtype="float32", max_seq_len=64, max_batch_size=2,
                                      prefill_budget=16, kv_cache_memory_gb=5 * block_bytes / 2**30))
    assert engine.cache.n_blocks == 5
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(TEXT[:90], bos=True)[:30], tokenizer.encode(TEXT[95:], bos=True)[:30]]
    params = SamplingParams(6, prompt_logprobs=2, ignore_eos=True)
    seqs = engine.generate([Sequence(str(i), ids, params) for i, ids in enumerate(prompts)])
    assert seqs[1].preemptions > 0 and [len(s.output) for s in seqs] == [6, 6]
    for seq, ids in zip(seqs, prompts):
        want = torch.log_softmax(reference.logits(ids), dim=-1)
        assert [e.token for e in seq.prompt_logprobs] == ids[1:]
        assert [e.logprob for e in seq.prompt_logprobs] == pytest.approx(
            [float(want[j, ids[j + 1]]) for j in range(len(ids) - 1)], abs=TOLERANCE)
        assert all(len(e.top) == 2 for e in seq.prompt_logprobs)


def test_ids_files_and_chunks_follow_llama_cpp() -> None:
    assert perplexity.read_ids("1 2,3\n4 , 5") == [1, 2, 3, 4, 5]
    assert perplexity.read_ids("[7, 8, 9]") == [7, 8, 9]
    with pytest.raises(ValueError, match="'x' is not an integer"):
        perplexity.read_ids("1 x 3")
    ids = list(range(10, 10 + 2 * 8 + 5))
    chunks = perplexity.chunk_ids(ids, 8, None, 1)
    assert chunks == [[1, *range(11, 18)], [1, *range(19, 26)]]  # BOS first, the 5-id tail left out
    assert perplexity.chunk_ids(ids, 8, 1, None) == [list(range(10, 18))]
    with pytest.raises(ValueError, match="need at least 16 tokens"):
        perplexity.chunk_ids(ids[:15], 8, None, 1)


def test_the_estimate_is_llama_cpps() -> None:
    values = [-1.0, -2.5, -0.25, -4.0]
    tally = perplexity.Tally()
    tally.add(values[:1])
    tally.add(values[1:])
    mean = -sum(values) / 4
    var = sum(v * v for v in values) / 4 - mean * mean
    assert tally.estimate() == pytest.approx((math.exp(mean), math.sqrt(var / 3) * math.exp(mean)), rel=1e-12)


def test_perplexity_matches_the_float64_reference(checkpoint: Path, reference: ReferenceModel, tmp_path: Path,
                                                  capfd) -> None:
    """--text: the scored tokens' log-probabilities and PPL agree with the reference; --ids with the
    same ids (another tokenizer's, as far as the command knows) gives the same numbers and full
    top-1 agreement; int8 weights stay close to them."""
    tokenizer = load_tokenizer(checkpoint / "tokenizer.model")
    ids = tokenizer.encode(TEXT, bos=True)
    want, want_top1, gaps = expected(reference, ids, tokenizer.bos_id)
    assert len(want) >= 3
    text, first = tmp_path / "text.txt", tmp_path / "first.json"
    text.write_text(TEXT, encoding="utf-8")
    common = ["--ckpt-dir", str(checkpoint), "--ctx", str(CTX), "--dtype", "float32", "--prefill-budget", "24"]
    code, out, err = run_cli(capfd, *common, "--text", str(text), "--json", str(first))
    assert code == 0, err
    got = json.loads(first.read_text())
    assert got["chunks"] == len(want) and got["tokens_scored"] == len(want) * (CTX - 1 - CTX // 2)
    assert [v for c in got["token_logprobs"] for v in c] == pytest.approx([v for c in want for v in c], abs=TOLERANCE)
    flat = [v for c in want for v in c]
    nll = -sum(flat) / len(flat)
    assert got["ppl"] == pytest.approx(math.exp(nll), rel=TOLERANCE)
    assert all(g == w or gap < NEAR_TIE for cg, cw, cgap in zip(got["top1"], want_top1, gaps)
               for g, w, gap in zip(cg, cw, cgap))
    assert f"[{len(want)}]" in err and "[1]" in err, err  # llama.cpp's progress, one cumulative PPL per chunk
    assert f"Final estimate: PPL = {got['ppl']:.4f} +/- {got['ppl_error']:.5f}" in out

    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(ids))
    code, out, err = run_cli(capfd, *common, "--ids", str(ids_file), "--compare-to", str(first))
    assert code == 0, err
    assert f"PPL = {got['ppl']:.4f}" in out and "top-1 agreement" in out and "100.00%" in out

    code, out, err = run_cli(capfd, *common, "--ids", str(ids_file), "--quantize", "int8", "--compare-to",
                             str(first), "--json", str(tmp_path / "int8.json"))
    assert code == 0, err
    int8 = json.loads((tmp_path / "int8.json").read_text())
    assert int8["ppl"] == pytest.approx(got["ppl"], rel=0.05) and int8["ppl"] != got["ppl"]  # the weights changed
    pairs = [(a, b) for ca, cb in zip(int8["top1"], got["top1"]) for a, b in zip(ca, cb)]
    assert int8["top1_agreement"] == sum(a == b for a, b in pairs) / len(pairs) > 0.5


def test_bad_inputs_are_refused_with_a_message(checkpoint: Path, tmp_path: Path, capfd) -> None:
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text(" ".join(["5"] * CTX))  # one chunk: too few
    code, _, err = run_cli(capfd, "--ckpt-dir", str(checkpoint), "--ids", str(ids_file), "--ctx", str(CTX))
    assert code == 2 and f"need at least {2 * CTX} tokens" in err
    ids_file.write_text(" ".join(["5"] * (2 * CTX - 1) + ["99999"]))
    code, _, err = run_cli(capfd, "--ckpt-dir", str(checkpoint), "--ids", str(ids_file), "--ctx", str(CTX))
    assert code == 2 and "token id 99999 lies outside the vocabulary" in err


def test_an_id_of_more_digits_than_int_reads_is_refused_with_a_message(checkpoint: Path, tmp_path: Path,
                                                                       capfd) -> None:
    """An --ids file is the user's input: a number past int()'s digit limit (4300 by default) is refused like any
    word that is no token id (exit status 2, an error line), never a traceback: int() raised a ValueError for it,
    and the search for the word that is no integer then found none and raised StopIteration."""
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text(" ".join(["5"] * (2 * CTX) + ["9" * 5000]))
    code, out, err = run_cli(capfd, "--ckpt-dir", str(checkpoint), "--ids", str(ids_file), "--ctx", str(CTX))
    assert code == 2 and f"--ids: {'9' * 20!r} is not an integer token id" in err
    assert "Traceback" not in err and "Final estimate" not in out


def test_compare_to_and_json_mismatches_are_refused_before_the_model_loads(checkpoint: Path, tmp_path: Path,
                                                                          capfd) -> None:
    """--compare-to a run of another --ctx that happens to score as many tokens per chunk (33 and 34:
    16 each), and --json naming a folder, stop with one line before any chunk is scored; so does a
    KV-cache pool too small for one chunk."""
    ids_file, first = tmp_path / "ids.txt", tmp_path / "first.json"
    ids_file.write_text(" ".join(str(5 + i % 50) for i in range(3 * 34)))
    common = ["--ckpt-dir", str(checkpoint), "--ids", str(ids_file), "--dtype", "float32", "--chunks", "2"]
    code, _, err = run_cli(capfd, *common, "--ctx", "33", "--json", str(first))
    assert code == 0, err
    code, out, err = run_cli(capfd, *common, "--ctx", "34", "--compare-to", str(first))
    assert code == 2 and "its chunks differ from this run's" in err and "Final estimate" not in out
    code, out, err = run_cli(capfd, *common, "--ctx", "33", "--json", str(tmp_path))
    assert code == 2 and f"--json {tmp_path}: a folder" in err and "Final estimate" not in out
    code, out, err = run_cli(capfd, *common, "--ctx", "33", "--kv-cache-memory-gb", "0.00001")
    assert code == 2 and "cannot hold one sequence" in err and "Traceback" not in err
