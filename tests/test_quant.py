"""Weights quantized at load: PyTorch's formats (kernels/quant.py) against their definitions and their
matmuls against float64 on the dequantized weights (the C kernels' are test_quant_kernels), and whole
engines on the C kernels at TP 1 and 2 against the float64 reference model on each rank's dequantized
slices, its matmuls' inputs quantized as the kernels' are."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.cli_util import launch_cli
from tests.support.reference import ReferenceModel, greedy, reassemble, read_config
from tp_llama.config import EngineConfig
from tp_llama.kernels import choose, linear, prepare
from tests.support.quantized import dequantize_groups, int8_rows, weight
from tp_llama.kernels.cpu.qtiles import quantize_groups
from tp_llama.kernels.quant import INT4_GROUP, dequantize, quantize, unpack_int4
from tp_llama.parallel.layout import shard_dim
from tp_llama.testing.synthetic import write_checkpoint
from tp_llama.tokenizer import load_tokenizer

MATMULS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")
NEAR_TIE = 0.05  # a reference logit gap under which a quantized engine may pick either token


def test_int8_is_symmetric_per_output_row_within_half_a_step():
    w = weight(40, 96)
    q = quantize(w, 8)
    assert q.data.dtype == torch.int8 and q.data.abs().max() <= 127 and q.scales.shape == (40,)
    step = w.abs().amax(dim=1, keepdim=True) / 127  # float32, as the weight: the same roundings
    assert torch.equal(q.data.float(), (w / step).round())
    assert ((dequantize(q) - w.double()).abs() <= step.double() / 2 * (1 + 1e-6)).all()


def test_int4_groups_along_k_hold_a_scale_and_a_minimum():
    w = weight(40, 96)
    q = quantize(w, 4)
    groups = w.view(40, 96 // INT4_GROUP, INT4_GROUP)  # float32, as the weight: the same roundings
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    expected = ((groups - low) / step.clamp(min=1e-30)).round().clamp(0, 15).view(40, 96)
    assert torch.equal(unpack_int4(q).float(), expected), "4-bit values (or their nibble order) differ"
    groups, low, high, step = groups.double(), low.double(), high.double(), step.double()
    error = (dequantize(q).view_as(groups) - groups).abs()
    assert (error <= step / 2 + 1e-6 * (high.abs() + low.abs())).all()
    assert (dequantize(q)[1, :INT4_GROUP] == 0.5).all(), "a constant group is exact"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_pytorch_quantized_matmul_matches_float64_on_the_dequantized_weight(bits: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    for out, k in ((2, 32), (70, 96), (130, 256)):
        q = prepare(weight(out, k).to(dtype), "plain", bits=bits)
        reference_weight = dequantize(q)
        for rows in (1, 5, 33):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            want = x.double() @ reference_weight.T
            got = linear(x, q)
            assert got.shape == (rows, out) and got.dtype == dtype
            tol = 1e-5 if dtype == torch.float32 else 2**-7  # summation order; bfloat16's output rounding
            scale = want.abs().max().item()
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale, msg=f"{out}x{k}, {rows} rows")


def test_quantize_needs_tensor_parallel_mode():
    with pytest.raises(ValueError, match="quantize 'int8' needs mode 'tp'"):
        EngineConfig("-", mode="fsdp", quantize="int8")
    with pytest.raises(ValueError, match="quantize must be one of"):
        EngineConfig("-", quantize="int3")


def test_int4_refuses_a_tp_whose_shards_split_a_group(tmp_path):
    """dim 96 at TP 2: wo's slice on each rank has k = 48, which groups of 32 do not divide."""
    ckpt = write_checkpoint(tmp_path / "ckpt", family="llama3", dim=96, n_heads=6, n_kv_heads=2, vocab_size=512)
    run = launch_cli(["--ckpt-dir", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2", "--quantize", "int4"], 2)
    assert run.returncode != 0
    assert "layers.0.attention.wo: this rank's slice has k = 48, which groups of 32 do not divide" in run.stderr, \
        run.stderr[-3000:]


def reference_weights(ckpt, family: str, tp: int, bits: int) -> tuple[ReferenceModel, object]:
    """The float64 reference on the weights each rank's quantized slices stand for, its matmuls' inputs
    quantized as the C kernels do."""
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    cfg = read_config(ckpt, tokenizer.n_words)
    weights = reassemble(ckpt, cfg)
    for key, value in weights.items():
        if key.split(".")[-2] not in MATMULS:
            continue
        dim = shard_dim(key, family) if tp > 1 else None
        parts = value.float().chunk(tp, dim) if dim is not None else [value.float()]
        part_bits = 8 if key == "output.weight" else bits  # int4 keeps the output layer in int8
        weights[key] = torch.cat([dequantize_groups(quantize_groups(part, part_bits)) for part in parts], dim=dim or 0)
    return ReferenceModel(cfg, weights, matmul_input=int8_rows), tokenizer


@pytest.mark.parametrize(("bits", "tp"), [(8, 2), (4, 1)])
def test_quantized_engine_generates_the_reference_tokens(tmp_path_factory, bits: int, tp: int):
    """int8 at TP 2 (a row-parallel layer's rows scaled per shard) and int4 at TP 1: each format through
    the whole engine once (the formats and matmuls at every shape are the tests above)."""
    family = "llama3" if tp == 2 else "llama2"
    ckpt = write_checkpoint(tmp_path_factory.mktemp("q") / "ckpt", family=family, mp=2, seed=bits, multiple_of=64)
    reference, tokenizer = reference_weights(ckpt, family, tp, bits)
    prompts = ["the lamp", "The keeper climbed the stairs at dusk and wrote the reading."]
    args = ["--ckpt-dir", str(ckpt), "--dtype", "float32", "--quantize", f"int{bits}", "--max-new-tokens", "10",
            "--ignore-eos"]
    for prompt in prompts:
        args += ["--prompt", prompt]
    run = launch_cli(args, tp)
    assert run.returncode == 0, run.stderr[-3000:]
    kind = choose(torch.device("cpu"), torch.float32)[0]  # AMX CPUs run the integer tiles as "amx"
    assert f"matmuls: {kind}, int{bits} weights" in run.stderr
    outputs = [json.loads(line)["token_ids"] for line in run.stdout.splitlines() if line.strip()]
    compared = 0
    for prompt, got in zip(prompts, outputs, strict=True):
        want = greedy(reference, tokenizer.encode(prompt, bos=True), 10, tokenizer.stop_ids, ignore_eos=True)
        # Quantizing each matmul's input turns float32's last bits into whole steps now and then, so
        # the tokens must agree up to the reference's first near-tie, not past it.
        clear = next((i for i, gap in enumerate(want.top2_gaps) if gap < NEAR_TIE), len(want.token_ids))
        assert got[:clear] == want.token_ids[:clear], \
            f"{prompt!r}: engine {got}, reference {want.token_ids} (gaps {want.top2_gaps})"
        compared += clear
    assert compared >= 8, f"only {compared} tokens before a near-tie: the test would check little"
