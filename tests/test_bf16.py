"""The dtype choice and the bfloat16 path, judged honestly against the float64 reference.

bfloat16 keeps 8 bits of mantissa, so its logits differ from exact ones and its greedy tokens may
part from them at a near tie. The checks: logits within a stated tolerance of the reference, and
greedy tokens equal to the reference's for as long as the reference's top-2 margin is clear.
"""

from __future__ import annotations


import pytest
import torch

from tests.support.reference import ReferenceModel, greedy
from tp_llama import config
from tp_llama.config import EngineConfig, resolve_dtype
from tp_llama.engine.core import Engine
from tp_llama.kernels.cpu import ffi
from tests.support.run_model import dense_logits
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.testing.synthetic import write_checkpoint

# bfloat16 rounds each matmul's inputs to ~3 significant digits: logits stay within this share
# of the largest logit, and a top-2 margin above CLEAR_MARGIN (in logits) never flips.
LOGIT_TOLERANCE = 0.05
CLEAR_MARGIN = 0.5
PROMPT = "The keeper climbed the stairs at dusk, lit the lamp and wrote the reading in the log."


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as info:
        return set(next(line for line in info if line.startswith("flags")).split(":", 1)[1].split())


def test_default_dtype_follows_the_device_and_cpu_and_names_win(monkeypatch):
    native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    kernels = ffi.load()[0] is not None  # the C kernels widen bfloat16 weights in registers
    assert resolve_dtype(None, torch.device("cpu")) == (torch.bfloat16 if native or kernels else torch.float32)
    monkeypatch.setattr(config, "cpu_flags", lambda: {"avx2", "fma"})  # AMD's Zen 3: no bfloat16 instructions
    assert resolve_dtype(None, torch.device("cpu")) == (torch.bfloat16 if kernels else torch.float32)
    monkeypatch.setenv("TP_LLAMA_MATMUL", "plain")  # without the C kernels bfloat16 takes PyTorch's slow paths
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    monkeypatch.undo()
    assert resolve_dtype(None, torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", torch.device("cpu"))


@pytest.fixture(scope="module", params=["llama2", "llama3"])
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, device: str):
    ckpt = write_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", family=request.param, mp=2)
    engine = Engine.load(EngineConfig(str(ckpt), "tp", "bfloat16", max_seq_len=128, max_batch_size=2, prefill_budget=64,
                                      device=device))
    return engine, ReferenceModel.load(ckpt, engine.tokenizer.n_words)


def test_bfloat16_engine_holds_bfloat16_weights_and_logits_near_the_reference(loaded):
    engine, reference = loaded
    assert engine.dtype == torch.bfloat16
    ids = engine.tokenizer.encode(PROMPT, bos=True)
    with torch.inference_mode():
        got = dense_logits(engine.model, torch.tensor([ids]), torch.zeros(1, dtype=torch.long), last_only=False)[0]
    want = reference.logits(ids)
    scale = want.abs().max().item()
    error = (got.double() - want).abs().max().item()
    assert error <= LOGIT_TOLERANCE * scale, f"largest logit error {error:.3g} against a scale of {scale:.3g}"
    assert error > 0, "bfloat16 logits equal to float64 ones: the engine did not run in bfloat16"


def test_bfloat16_picks_the_reference_token_wherever_its_margin_is_clear(loaded):
    """Teacher-forced on the reference's greedy tokens: at every position where the reference's
    best token leads by CLEAR_MARGIN or more, bfloat16's argmax is that token."""
    engine, reference = loaded
    ids = engine.tokenizer.encode(PROMPT, bos=True)
    want = greedy(reference, ids, 24, engine.tokenizer.stop_ids, ignore_eos=True)
    sequence = ids + want.token_ids
    with torch.inference_mode():
        logits = dense_logits(engine.model, torch.tensor([sequence]), torch.zeros(1, dtype=torch.long),
                              last_only=False)[0]
    picks = logits[len(ids) - 1 : -1].argmax(dim=-1).tolist()
    clear = [i for i, gap in enumerate(want.top2_gaps) if gap >= CLEAR_MARGIN]
    assert len(clear) >= 5, f"the reference's margins are too small to judge: {want.top2_gaps}"
    wrong = [(i, picks[i], want.token_ids[i], round(want.top2_gaps[i], 3)) for i in clear if picks[i] != want.token_ids[i]]
    assert not wrong, f"(position, bfloat16 pick, reference token, reference margin): {wrong}"


def test_bfloat16_generation_runs_through_the_scheduler(loaded):
    engine, _ = loaded
    seq = Sequence("bf16", engine.tokenizer.encode(PROMPT, bos=True), SamplingParams(8, ignore_eos=True))
    engine.generate([seq])
    assert len(seq.output) == 8 and seq.finish_reason == "length"
