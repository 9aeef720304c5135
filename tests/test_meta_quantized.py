"""Meta's own quantized checkpoints served as they come: int4 QLoRA / SpinQuant (torchao's 8da4w) and
fp8 (Llama 3.1 405B's layout).

The checkpoints are small ones written the way Meta's files hold them (tp_llama.testing.meta_quant),
their int4 weights made by torchao's own quantizer. The matmul is checked against torchao's own
Int8DynActInt4WeightLinear (float32, as Meta's loader runs it) and Meta's adaptor definition; whole
models against a float64 reference that dequantizes the files itself and quantizes each layer's input
per token as torchao defines it (the whole row's range, whatever the TP), applies the Hadamard matrix
(built here as Sylvester's) before SpinQuant's w2 and adds x A^T B^T scale; fp8 against float64 on the
files' float8 values times their row scales.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.support.cli_util import launch_cli
from tests.support.reference import ReferenceModel, greedy, read_config, split_dim
from tests.support.run_model import dense_logits, setup_slots, steps_in_c_and_op_by_op
from tp_llama import backend
from tp_llama.checkpoint.formats import read_format
from tp_llama.checkpoint.loader import load_tp_model
from tp_llama.checkpoint.params import read_params
from tp_llama.errors import CheckpointError
from tp_llama.kernels import linear
from tp_llama.kernels.meta_int4 import (Int4Weight, fuse_int4, hadamard_in_c, int4_linear, int8_tiles, pack_tiles,
                                       quantize_rows, rotate, row_bounds, walsh_hadamard)
from tp_llama.parallel.distributed import DistInfo
from tp_llama.testing.meta_quant import write_fp8_checkpoint, write_int4_checkpoint
from tp_llama.tokenizer import load_tokenizer

torchao = pytest.importorskip("torchao.quantization.linear_quant_modules", reason="torchao makes the int4 checkpoints")
warnings.filterwarnings("ignore", module="torchao")

REPO = Path(__file__).resolve().parents[1]
NEAR_TIE = 0.05  # a reference logit gap under which a quantized engine may pick either token
SMALL = dict(dim=128, n_layers=3, n_heads=8, n_kv_heads=4, multiple_of=32, ffn_dim_multiplier=1.5)  # FFN 512
WIDE = dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, multiple_of=256, ffn_dim_multiplier=1.5)  # FFN 1024
CPU = DistInfo(0, 1, 0, torch.device("cpu"), "none")


def served_as_tiles() -> bool:
    """Whether this machine serves Meta's int4 layers on the C kernels' int4 tiles (kernels.meta_int4.pack_tiles)."""
    return backend.preparation_for(CPU.device, torch.float32).kind in ("amx", "tiles")


def torchao_layer(out: int, k: int, group: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(k, out, bias=False)
    linear.weight.data = torch.randn(out, k, generator=gen) / math.sqrt(k)
    quantizer = torchao.Int8DynActInt4WeightQuantizer(groupsize=group, precision=torch.float32)
    state = quantizer._create_quantized_state_dict(torch.nn.Sequential(linear))
    return quantizer.quantize(torch.nn.Sequential(linear))[0], state


@pytest.mark.parametrize("packing", ["pytorch", "c-tiles"])
@pytest.mark.parametrize("group", [32, 256])
def test_int4_matmul_is_torchaos_8da4w_with_metas_adaptor(group: int, packing: str):
    """On PyTorch's int4 op, and on the C kernels' int4 tiles (their fp16 scales and minimums round the
    weight by up to 2^-11 of a group's scale)."""
    module, state = torchao_layer(80, 512, group)
    gen = torch.Generator().manual_seed(3)
    module.zeros.copy_(torch.randint(-2, 3, module.zeros.shape, generator=gen).float())  # zero points too
    # bfloat16 values, as Meta ships its adaptors (the C tiles keep them in bfloat16)
    a = (torch.randn(4, 512, generator=gen) / 20).bfloat16().float()
    b = (torch.randn(80, 4, generator=gen) / 2).bfloat16().float()
    weight = Int4Weight((80, 512), group, state["0.weight"], state["0.scales"], module.zeros.clone(), a, b, 2.0)
    rows = torch.randn(9, 512, generator=gen) * 3
    rows[1] = rows[1].abs() + 1  # a row of one sign: its range is widened to zero
    rows[2] = 0
    want = module(rows) + (rows @ a.T) @ b.T * 2.0  # Meta's Int8DynActInt4WeightLinearLoRA.forward
    if packing == "c-tiles":
        weight = pack_tiles(weight)
        assert weight.tiles is not None
    got = int4_linear(rows, weight)
    bound = 1e-5 if packing == "pytorch" else 2e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=bound * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_tiles_quantize_each_row_as_pytorch_does(dtype: torch.dtype):
    """Without zero points the tiles hold w = s16 * q exactly, so they must give PyTorch's int4 op on the
    same fp16-rounded scales to float32 rounding: one activation rounded to another step would move an
    output by about 1e-3 of the outputs' scale."""
    if not served_as_tiles():
        pytest.skip("the C kernels are not built here")
    module, state = torchao_layer(96, 512, 32, seed=5)
    scales16 = state["0.scales"].half().float()
    rows = (torch.randn(7, 512, generator=torch.Generator().manual_seed(6)) * 2).to(dtype)
    rows[3] = rows[3].abs()  # a row of one sign
    got = int4_linear(rows, pack_tiles(Int4Weight((96, 512), 32, state["0.weight"], state["0.scales"])))
    want = int4_linear(rows.float(), Int4Weight((96, 512), 32, state["0.weight"], scales16)).to(dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * want.abs().max().item())


def test_bfloat16_models_take_exact_input_steps_and_scale_pairs():
    """A bfloat16 model's int4 matmuls: the input's integer steps (exact in bfloat16), each scale as two
    bfloat16 parts, two matmuls whose bfloat16 outputs are summed in float32: within bfloat16's rounding
    of the output of torchao's float32 module."""
    from tp_llama.kernels.meta_int4 import pack

    module, state = torchao_layer(96, 256, 32, seed=2)
    weight = pack(Int4Weight((96, 256), 32, state["0.weight"], state["0.scales"], state["0.zeros"]),
                  torch.device("cpu"), bf16=True)
    assert weight.scales_zeros.shape == (2, 8, 96, 2) and weight.scales_zeros.dtype == torch.bfloat16
    rows = (torch.randn(6, 256, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    want = module(rows.float())
    got = int4_linear(rows, weight).float()
    # Two bfloat16 roundings (each part's output) and their sum: up to about 2 ulps of the largest output.
    torch.testing.assert_close(got, want, rtol=0, atol=2**-7 * want.abs().max().item())


def test_activations_quantize_as_torchaos_per_token_asymmetric_int8():
    from torchao.quantization.utils import per_token_dynamic_quant

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    x[0] = x[0].abs()
    x[1] = -x[1].abs()
    x[2] = 0
    want = per_token_dynamic_quant(x, torch.float32, torch.float32, eps=torch.finfo(torch.float32).eps)
    assert torch.equal(quantize_rows(x, row_bounds(x)), want)


class Shards:
    """meta_int4.Across for `size` ranks simulated in one process (rank `rank` of them)."""

    def __init__(self, parts: list[torch.Tensor], rank: int):
        self.parts, self.rank, self.size = parts, rank, len(parts)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x if r == self.rank else p for r, p in enumerate(self.transformed)])

    def row_range(self, bounds: torch.Tensor) -> torch.Tensor:
        return torch.stack([row_bounds(p) for p in self.parts]).amax(0)


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hadamard_across_shards_is_the_whole_rows_transform(tp: int):
    x = torch.randn(5, 256, dtype=torch.float64)
    want = x @ sylvester(256).T
    parts = list(x.chunk(tp, dim=1))
    for rank in range(tp):
        shards = Shards(parts, rank)
        shards.transformed = [walsh_hadamard(p, normalize=False) for p in parts]
        got, bounds = rotate(parts[rank], shards if tp > 1 else None)
        torch.testing.assert_close(got, want.chunk(tp, dim=1)[rank], rtol=0, atol=1e-12)
        torch.testing.assert_close(bounds, row_bounds(want), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [256, 8192])
def test_the_c_hadamard_transform_is_pytorchs_bit_for_bit(n: int):
    if not served_as_tiles():
        pytest.skip("the C kernels are not built here")
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(hadamard_in_c(x), walsh_hadamard(x))
    assert torch.allclose(walsh_hadamard(x).double(), x.double() @ sylvester(n).T, atol=1e-5)


def test_fused_int4_weights_give_each_weights_outputs():
    layers = [torchao_layer(n, 128, 32, seed)[1] for seed, n in enumerate((64, 32, 32))]
    gen = torch.Generator().manual_seed(0)
    weights = [Int4Weight((s["0.weight"].shape[0], 128), 32, s["0.weight"], s["0.scales"], s["0.zeros"],
                          torch.randn(4, 128, generator=gen), torch.randn(s["0.weight"].shape[0], 4, generator=gen),
                          2.0) for s in layers]
    x = torch.randn(7, 128, generator=gen)
    fused = fuse_int4(weights)  # before they run: a weight is packed (its int8 values dropped) as it first runs
    if served_as_tiles():  # the C tiles keep only B's diagonal blocks: each output sums its own part's ranks
        tiled = torch.cat([int4_linear(x, pack_tiles(w)) for w in weights], dim=1)
        assert pack_tiles(fused).lora_parts == (64, 32, 32)
        assert torch.equal(int4_linear(x, pack_tiles(fused)), tiled)
    separate = torch.cat([int4_linear(x, w) for w in weights], dim=1)
    # The same matmul per output; the adaptor's B block-diagonal sums its zeros in another order.
    torch.testing.assert_close(int4_linear(x, fused), separate, rtol=0, atol=1e-6 * separate.abs().max().item())


@pytest.mark.skipif(not served_as_tiles(), reason="the pair tiles are the C kernels' (AVX2 or AVX-512 and a compiler)")
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_int8_output_layer_runs_on_16_bit_inputs(groups: int, dtype: torch.dtype):
    """Meta's int8 output layer on the C kernels' pair tiles: its int8 values exact, its scales in fp16 and
    each input quantized to int16 per block of 32, against float64 on the file's values."""
    gen = torch.Generator().manual_seed(7)
    out, k = 203, 256  # a ragged last tile
    q = torch.randint(-127, 128, (out, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(out, groups, generator=gen) * 0.02 + 1e-3
    x = (torch.randn(5, k, generator=gen) * 3).to(dtype)

    def weight(s: torch.Tensor) -> torch.Tensor:
        return (q.double().view(out, groups, -1) * s.double()[..., None]).view(out, k)

    got = linear(x, int8_tiles(q, scales.squeeze(1) if groups == 1 else scales)).double()
    held = x.double() @ weight(scales.half()).T  # the scales as the tiles hold them, in fp16
    magnitude = x.double().abs() @ weight(scales).abs().T
    # int16 inputs err by up to 2^-16 of their block's largest a value; bfloat16 outputs round by 2^-9
    assert ((got - held).abs() <= 2**-15 * magnitude + (2**-8 if dtype == torch.bfloat16 else 0) * held.abs()).all()
    # fp16 scales err by up to 2^-11 of each product: less than a bfloat16 model's own weights (2^-9)
    assert ((held - x.double() @ weight(scales).T).abs() <= 2**-11 * magnitude).all()
    assert int8_tiles(q, torch.rand(out, 16, generator=gen)) is None  # groups of 16: no whole blocks of 32
    assert int8_tiles(q, torch.full((out,), 1e-6)) is None  # under fp16's normal range


# ---- whole models against the float64 reference --------------------------------------------------------------


def per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """torchao's per-token asymmetric int8, in float64, over each whole row."""
    high, low = x.amax(-1, keepdim=True).clamp(min=0), x.amin(-1, keepdim=True).clamp(max=0)
    scale = ((high - low) / 255).clamp(min=torch.finfo(torch.float32).eps)
    zero = (-128 - torch.round(low / scale)).clamp(-128, 127)
    return ((torch.round(x / scale) + zero).clamp(-128, 127) - zero) * scale


@dataclass
class Int4Reference(ReferenceModel):
    adaptors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    lora_scale: float = 0.0
    hadamard: torch.Tensor | None = None

    def mm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if name == "output.weight":
            return x @ self.weights[name].T
        if self.hadamard is not None and name.endswith("w2.weight"):
            x = x @ self.hadamard.T
        y = per_token_int8(x) @ self.weights[name].T
        if name in self.adaptors:
            a, b = self.adaptors[name]
            y = y + x @ a.T @ b.T * self.lora_scale
        return y


def int4_reference(ckpt, fp16_scales: bool = False) -> tuple[Int4Reference, object]:
    """fp16_scales: each layer's weight as the C tiles hold it, w = (q + 8) * s16 + m16 with the scale s
    rounded to fp16 and the minimum -(8 + zero) * s16 rounded to fp16 (ExecuTorch's XNNPACK kernels round
    Meta's scales to bfloat16)."""
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    cfg = read_config(ckpt, tokenizer.n_words)
    params = json.loads((ckpt / "params.json").read_text())
    group = params["quantization_args"]["group_size"]
    state = torch.load(ckpt / "consolidated.00.pth", weights_only=True)
    weights, adaptors = {}, {}
    for key, tensor in state.items():
        if key.endswith((".scales", ".zeros")) or ".adaptor." in key:
            continue
        base = key.removesuffix(".weight")
        if tensor.dtype != torch.int8:
            weights[key] = tensor.double()
        elif base in ("tok_embeddings", "output"):
            weights[key] = tensor.double() * state[f"{base}.scales"].double().reshape(tensor.shape[0], -1)
        else:
            q = tensor.double().unflatten(1, (-1, group))
            zeros = state.get(f"{base}.zeros", torch.zeros(1)).double()
            scales = state[f"{base}.scales"]
            if fp16_scales:
                s16 = scales.half().float()
                m16 = (-s16 * (8 + zeros.float())).half().double()
                weights[key] = ((q + 8) * s16.double()[..., None] + m16[..., None]).flatten(1)
            else:
                weights[key] = ((q - zeros[..., None] if zeros.dim() else q) * scales.double()[..., None]).flatten(1)
            if f"{base}.adaptor.A.weight" in state:
                adaptors[key] = (state[f"{base}.adaptor.A.weight"].double(), state[f"{base}.adaptor.B.weight"].double())
    fmt = read_format(ckpt, 1)
    hadamard = sylvester(cfg.ffn_dim) if fmt.hadamard else None
    return Int4Reference(cfg, weights, adaptors=adaptors, lora_scale=fmt.lora_scale, hadamard=hadamard), tokenizer


def fp8_reference(ckpt, mp: int) -> tuple[ReferenceModel, object]:
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    cfg = read_config(ckpt, tokenizer.n_words)
    files = []
    for m in range(mp):
        state = torch.load(ckpt / f"consolidated.{m:02d}.pth", weights_only=True)
        scales = torch.load(ckpt / f"fp8_scales_{m}.pt", weights_only=True)
        for key, tensor in state.items():
            state[key] = tensor.double()
            if tensor.dtype == torch.float8_e4m3fn:
                layer, w = key.split(".")[1], key.split(".")[3]
                state[key] *= scales[f"{layer}_feed_forward.{w}_{m}"].double()[:, None]
        files.append(state)
    weights = {}
    for key in files[0]:
        dim = split_dim(key, "llama3")
        weights[key] = files[0][key] if dim is None else torch.cat([f[key] for f in files], dim=dim)
    return ReferenceModel(cfg, weights), tokenizer


def served_logits(ckpt, tokens: list[int]) -> torch.Tensor:
    """This process's served model (TP 1, float32, the backend applied as it loads) on one sequence."""
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    args = read_params(ckpt, tokenizer.n_words)
    model = load_tp_model(ckpt, args, CPU, torch.float32, backend.preparation_for(CPU.device, torch.float32))
    setup_slots(model, 1, 64, torch.float32, CPU.device)
    return dense_logits(model, torch.tensor([tokens]), torch.tensor([0]), last_only=False)[0].double()


PROMPTS = ["the lamp", "The keeper climbed the stairs at dusk and wrote the reading."]


def same_greedy(ckpt, reference, tokenizer, tp: int, exact: bool = False) -> None:
    """The engine (the CLI, TP ranks over gloo) picks the reference's greedy tokens: all of them (exact),
    else up to the reference's first near-tie."""
    args = ["--ckpt-dir", str(ckpt), "--dtype", "float32", "--max-new-tokens", "8", "--ignore-eos"]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    run = launch_cli(args, tp)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "checkpoint format: Meta" in run.stderr
    outputs = [json.loads(line)["token_ids"] for line in run.stdout.splitlines() if line.strip()]
    compared = 0
    for prompt, got in zip(PROMPTS, outputs, strict=True):
        want = greedy(reference, tokenizer.encode(prompt, bos=True), 8, tokenizer.stop_ids, ignore_eos=True)
        clear = len(want.token_ids) if exact else \
            next((i for i, gap in enumerate(want.top2_gaps) if gap < NEAR_TIE), len(want.token_ids))
        assert got[:clear] == want.token_ids[:clear], f"{prompt!r}: engine {got}, reference {want}"
        compared += clear
    assert compared >= 6, f"only {compared} tokens before a near-tie: the test would check little"


INT4_CASES = {  # TP 1, in this process
    "qlora-g32": dict(group=32, lora_rank=4, zeros=True, **SMALL),
    "spinquant-g256": dict(group=256, spinquant=None, zeros=False, scheme=True, **WIDE),
}


@pytest.mark.skipif(not served_as_tiles(), reason="the C kernels' decode layers need AVX2 or AVX-512 and a compiler")
@pytest.mark.parametrize("case", list(INT4_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@torch.inference_mode()
def test_int4_layers_in_c_give_the_op_by_op_bits(tmp_path, case: str, dtype: torch.dtype):
    """Without TP a decode step's int4 layers run in one C call (decode.c, QLoRA's adaptor and SpinQuant's
    rotation inside): the bits of the same blocks op by op, which the float64 reference checks below."""
    ckpt = write_int4_checkpoint(tmp_path / "ckpt", seed=4, **INT4_CASES[case])
    args = read_params(ckpt, load_tokenizer(ckpt / "tokenizer.model").n_words)
    model = load_tp_model(ckpt, args, CPU, dtype, backend.preparation_for(CPU.device, dtype))
    setup_slots(model, 4, 64, dtype, CPU.device)
    assert model.layers._structs() is not None
    steps_in_c_and_op_by_op(model, args.vocab_size)


@pytest.mark.parametrize("case", list(INT4_CASES))
def test_int4_logits_match_the_float64_reference(tmp_path, case: str):
    ckpt = write_int4_checkpoint(tmp_path / "ckpt", seed=4, **INT4_CASES[case])
    reference, tokenizer = int4_reference(ckpt, served_as_tiles())
    tokens = tokenizer.encode(PROMPTS[1], bos=True)
    want = reference.logits(tokens)
    got = served_logits(ckpt, tokens)
    # float32 against float64: now and then an input element lands on a rounding boundary of its int8 step
    # and rounds the other way, and the step spreads through attention to the later positions. Leaving out
    # the input quantization moves these logits by about twice this bound; leaving out the adaptor or the
    # Hadamard transform, by about the logits themselves.
    torch.testing.assert_close(got, want, rtol=0, atol=0.04 * want.abs().max().item())


def test_int4_logits_match_metas_own_model_code(tmp_path, monkeypatch):
    """Meta's Llama 3 model code with its int4 loader's modules (torchao's, float32; tests/support/
    meta_int4_model.py) on a QLoRA checkpoint: the float64 reference agrees with it, and so do we, on
    PyTorch's int4 op (float32 scales, as Meta's) and on the C tiles (fp16 scales)."""
    pytest.importorskip("fairscale", reason="Meta's model code runs on fairscale's layers")
    ckpt = write_int4_checkpoint(tmp_path / "ckpt", seed=4, **INT4_CASES["qlora-g32"])
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    tokens = tokenizer.encode(PROMPTS[1], bos=True)
    run = subprocess.run([sys.executable, "-m", "tests.support.meta_int4_model", str(ckpt), json.dumps(tokens),
                          str(tmp_path / "meta.pt")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    meta = torch.load(tmp_path / "meta.pt").double()
    scale = meta.abs().max().item()
    # As in the float64 test above: an input element on an int8 rounding boundary now and then rounds the other
    # way in float32, and its step spreads through attention.
    torch.testing.assert_close(int4_reference(ckpt)[0].logits(tokens), meta, rtol=0, atol=0.04 * scale)
    monkeypatch.setenv("TP_LLAMA_MATMUL", "plain")
    plain = served_logits(ckpt, tokens)
    torch.testing.assert_close(plain, meta, rtol=0, atol=0.04 * scale)
    clear = (meta.topk(2).values.diff(dim=-1).abs() > NEAR_TIE).squeeze(-1)
    assert clear.sum() >= len(tokens) // 2 and torch.equal(plain.argmax(-1)[clear], meta.argmax(-1)[clear])
    monkeypatch.delenv("TP_LLAMA_MATMUL")
    if served_as_tiles():  # fp16 scales move the quantized inputs' rounding further: twice the bound
        torch.testing.assert_close(served_logits(ckpt, tokens), meta, rtol=0, atol=0.08 * scale)


def test_int4_engine_at_tp_2_generates_the_reference_tokens(tmp_path):
    """QLoRA's adaptors and SpinQuant's rotation at once, at TP 2: the adaptors split with their layers, w2's
    Hadamard transform spans both ranks, and wo's and w2's inputs quantize over the whole row's range."""
    ckpt = write_int4_checkpoint(tmp_path / "ckpt", group=32, lora_rank=4, spinquant=True, seed=5, **SMALL)
    reference, tokenizer = int4_reference(ckpt, served_as_tiles())
    same_greedy(ckpt, reference, tokenizer, tp=2)


def test_fp8_logits_match_the_float64_reference(tmp_path):
    """MP 2 onto TP 1: each rank's w2 takes both files' column blocks, each with its own row scales."""
    ckpt = write_fp8_checkpoint(tmp_path / "ckpt", mp=2, seed=2, **SMALL)
    reference, tokenizer = fp8_reference(ckpt, 2)
    tokens = tokenizer.encode(PROMPTS[1], bos=True)
    want = reference.logits(tokens)
    torch.testing.assert_close(served_logits(ckpt, tokens), want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_fp8_engine_at_tp_2_generates_the_reference_tokens(tmp_path):
    ckpt = write_fp8_checkpoint(tmp_path / "ckpt", mp=2, seed=3, **SMALL)
    reference, tokenizer = fp8_reference(ckpt, 2)
    same_greedy(ckpt, reference, tokenizer, tp=2, exact=True)


# ---- broken checkpoints fail at load, naming the file and the tensor -------------------------------------------


def load(ckpt, quantize: str = "none", tp: int = 1):
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    args = read_params(ckpt, tokenizer.n_words)
    if tp > 1:
        from tp_llama.checkpoint.quantized import Layout
        from tp_llama.checkpoint.shards import find_shards

        paths = find_shards(ckpt)
        return Layout.build(args, read_format(ckpt, len(paths)), paths, tp, torch.float32, CPU.device)
    return load_tp_model(ckpt, args, CPU, torch.float32,
                         backend.preparation_for(CPU.device, torch.float32, quantized=quantize))


def edit_params(ckpt, **quantization_args) -> None:
    params = json.loads((ckpt / "params.json").read_text())
    params["quantization_args"].update(quantization_args)
    (ckpt / "params.json").write_text(json.dumps(params))


@pytest.fixture(scope="module")
def int4_ckpt(tmp_path_factory):
    return write_int4_checkpoint(tmp_path_factory.mktemp("bad") / "ckpt", group=32, lora_rank=2, **SMALL)


@pytest.fixture
def int4_copy(int4_ckpt, tmp_path):
    import shutil

    return shutil.copytree(int4_ckpt, tmp_path / "ckpt")


def test_the_format_is_read_from_the_checkpoint(int4_ckpt, tmp_path):
    fmt = read_format(int4_ckpt, 1)
    assert (fmt.kind, fmt.group, fmt.lora_rank, fmt.lora_scale, fmt.hadamard) == ("int4", 32, 2, 2.0, False)
    assert "LoRA rank 2" in fmt.describe()
    spin = write_int4_checkpoint(tmp_path / "spin", group=32, spinquant=None, **SMALL)
    assert read_format(spin, 1).hadamard and "no lora_args" in read_format(spin, 1).hadamard_why


@pytest.mark.parametrize(("change", "message"), [
    (dict(group_size=48), "quantization_args.group_size 48 does not divide k = 128 of tensor "
                          "'layers.0.attention.wq.weight'"),
    (dict(group_size=64), "consolidated.00.pth: tensor 'layers.0.attention.wq.scales' has shape (128, 4) for a "
                          "weight of shape (128, 128): groups of 32 along k = 128, but params.json's "
                          "quantization_args.group_size is 64"),
    (dict(scheme="int8_weight_only"), "quantization_args.scheme 'int8_weight_only' is unknown"),
    (dict(spinquant=True), "SpinQuant's Hadamard transform on w2's input needs a power of two for the FFN width"),
])
def test_a_bad_int4_checkpoint_fails_at_load(int4_copy, change: dict, message: str):
    edit_params(int4_copy, **change)
    if change.get("spinquant"):
        params = json.loads((int4_copy / "params.json").read_text())
        params["ffn_dim_multiplier"] = 1.25  # FFN 448
        (int4_copy / "params.json").write_text(json.dumps(params))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load(int4_copy)


def test_quantizing_a_quantized_checkpoint_is_refused(int4_ckpt):
    with pytest.raises(CheckpointError, match=r"quantize 'int4' was asked for, but this checkpoint comes quantized "
                                              r"\(Meta int4 checkpoint.*set quantize to none"):
        load(int4_ckpt, "int4")


def test_a_tp_that_splits_int4_groups_is_refused(tmp_path):
    ckpt = write_int4_checkpoint(tmp_path / "ckpt", group=256, lora_rank=2, **WIDE)
    with pytest.raises(CheckpointError, match=re.escape("tensor-parallel size 2 splits the groups of "
                                                        "layers.0.attention.wo: its k holds 1 groups of 256")):
        load(ckpt, tp=2)


@pytest.fixture
def fp8_ckpt(tmp_path):
    return write_fp8_checkpoint(tmp_path / "ckpt", mp=2, **SMALL)


def test_a_missing_fp8_scale_file_is_named(fp8_ckpt):
    (fp8_ckpt / "fp8_scales_1.pt").unlink()
    with pytest.raises(CheckpointError,
                       match=re.escape("fp8_scales_1.pt is missing: the row scales of consolidated.01.pth")):
        load(fp8_ckpt)


def test_a_truncated_fp8_scale_file_is_named(fp8_ckpt):
    path = fp8_ckpt / "fp8_scales_1.pt"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: cannot be read as a PyTorch file")):
        load(fp8_ckpt)


def test_a_missing_or_misshapen_fp8_scale_is_named(fp8_ckpt):
    path = fp8_ckpt / "fp8_scales_0.pt"
    scales = torch.load(path, weights_only=True)
    scales["1_feed_forward.w3_0"] = scales["1_feed_forward.w3_0"][:-1]
    del scales["1_feed_forward.w2_0"]
    torch.save(scales, path)
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: no scale '1_feed_forward.w2_0' for the float8 "
                                                        "tensor 'layers.1.feed_forward.w2.weight'")):
        load(fp8_ckpt)
    del scales["1_feed_forward.w3_0"]
    scales["1_feed_forward.w2_0"] = torch.ones(3)
    torch.save(scales, path)
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: scale '1_feed_forward.w2_0' has shape (3,): "
                                                        "expected [128] floats")):
        load(fp8_ckpt)


def test_float8_weights_without_any_scale_file_are_refused(fp8_ckpt):
    """With every fp8_scales_N.pt gone the folder looks 16-bit; its float8 weights must not be read as
    values (each weight's row scale missing), but named with the file."""
    for path in fp8_ckpt.glob("fp8_scales_*.pt"):
        path.unlink()
    with pytest.raises(CheckpointError, match=r"consolidated\.00\.pth: tensor 'layers\.1\.feed_forward\.w\d\.weight' "
                                              r"is torch\.float8_e4m3fn; .*fp8_scales_N\.pt"):
        load(fp8_ckpt)


def test_a_float8_weight_the_first_file_holds_in_16_bits_is_refused(fp8_ckpt):
    """Which weights are float8 is read from the first file: a float8 one only in another has no scale taken."""
    path = fp8_ckpt / "consolidated.01.pth"
    state = torch.load(path, weights_only=True)
    state["layers.0.feed_forward.w1.weight"] = state["layers.0.feed_forward.w1.weight"].to(torch.float8_e4m3fn)
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"consolidated\.01\.pth: tensor 'layers\.0\.feed_forward\.w1\.weight' "
                                              r"is torch\.float8_e4m3fn"):
        load(fp8_ckpt)
