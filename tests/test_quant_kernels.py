"""The C kernels' quantized weights (kernels/cpu/qtiles.py, quant.c): the groups against their
definitions, and the integer-tile matmuls against float64 on the dequantized groups with the inputs
quantized as defined. The lesser builds run this module too (test_kernels)."""

from __future__ import annotations

import pytest
import torch

from tests.support.quantized import dequantize_groups, groups_of, int8_rows, weight
from tp_llama.kernels import linear, prepare
from tp_llama.kernels.cpu.qtiles import (
    ROWS_AT_ONCE,
    QuantTiled,
    pack,
    pack_pairs,
    prepare_quant_swiglu,
    prepare_quant_tiles,
    quantize_groups,
)
from tp_llama.kernels.cpu.ffi import load
from tp_llama.kernels.meta_int4 import Int4Weight, pack_tiles
from tp_llama.kernels.quant import INT4_GROUP

pytestmark = pytest.mark.skipif(load()[0] is None, reason="no C kernels on this machine (compiler or CPU)")


def test_c_int8_groups_are_symmetric_with_an_fp16_scale():
    """Without refits a group's scale is its max |w| / 127; the least-squares refits only lower its error."""
    w = weight(40, 96)
    q, scales = quantize_groups(w, 8, refits=0)
    step = (groups_of(w).abs().amax(-1) / 127).half()
    assert torch.equal(scales, step), "each group's scale: its max |w| / 127 in fp16"
    expected = (groups_of(w) / step.float()[..., None]).round().clamp(-127, 127)
    assert torch.equal(groups_of(q).float(), expected)
    error = (dequantize_groups((q, scales)) - w.double()).abs()
    assert (groups_of(error) <= step.double()[..., None] * (0.5 + 2**-10)).all()
    refit = quantize_groups(w, 8)
    assert refit[0].abs().max() <= 127
    plain = groups_of(error**2).sum(-1)
    fitted = groups_of((dequantize_groups(refit) - w.double()) ** 2).sum(-1)
    assert (fitted <= plain * (1 + 1e-9)).all() and (fitted < plain * 0.999).any()


def test_c_int4_groups_fit_at_least_as_well_as_their_range():
    """Without refits a group is its range in 16 steps; the least-squares refits only lower its error."""
    w = weight(40, 96)
    low, high = groups_of(w).amin(-1), groups_of(w).amax(-1)
    step, low16 = ((high - low) / 15).half(), low.half()
    q, scales, mins = quantize_groups(w, 4, refits=0)
    assert torch.equal(scales, step) and torch.equal(mins, low16)
    expected = ((groups_of(w) - low16.float()[..., None]) / step.float()[..., None].clamp(min=1e-30))
    assert torch.equal(groups_of(q).float(), expected.round().clamp(0, 15)), "4-bit values differ"
    plain = groups_of((dequantize_groups((q, scales, mins)) - w.double()) ** 2).sum(-1)
    refit = quantize_groups(w, 4)
    assert refit[0].min() >= 0 and refit[0].max() <= 15
    fitted = groups_of((dequantize_groups(refit) - w.double()) ** 2).sum(-1)
    assert (fitted <= plain * (1 + 1e-9)).all() and (fitted < plain * 0.99).float().mean() > 0.5
    assert (dequantize_groups(refit)[1, :INT4_GROUP] == 0.5).all(), "a constant group is exact"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_c_quantized_matmul_matches_float64(bits: int, dtype: torch.dtype):
    """The tiles against float64 on the dequantized groups and the inputs quantized by definition: a
    wrong scale, minimum, nibble order or tile layout is off by far more than the tolerance."""
    gen = torch.Generator().manual_seed(1)
    for out, k in ((2, 32), (70, 96), (130, 256)):
        w = weight(out, k).to(dtype)
        groups = quantize_groups(w, bits)
        tiles = pack(groups, bits)
        assert isinstance(prepare(w, "tiles", bits=bits), QuantTiled)
        for rows in (1, 5, 33):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            want = int8_rows(x) @ dequantize_groups(groups).T
            got = linear(x, tiles)
            assert got.shape == (rows, out) and got.dtype == dtype
            tol = 1e-6 if dtype == torch.float32 else 2**-8  # float32 sums of exact integer blocks; bfloat16 output
            scale = want.abs().max().item()
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale, msg=f"{out}x{k}, {rows} rows")
            alone = torch.cat([linear(x[i : i + 1], tiles) for i in range(rows)])
            assert torch.equal(alone, got), "a row's outputs depend on its batch"


@pytest.mark.parametrize("bits", [8, 4])
def test_a_weight_packed_in_row_chunks_is_the_weight_packed_whole(bits: int):
    w = weight(ROWS_AT_ONCE + 40, 64)
    assert torch.equal(prepare_quant_tiles(w, bits).data, pack(quantize_groups(w, bits), bits).data)


@pytest.mark.parametrize("bits", [8, 4])
def test_groups_in_any_memory_layout_pack_as_contiguous_ones(bits: int):
    """Meta's int4 weights come as a checkpoint stored them: a transposed copy must not be read row by row."""
    groups = quantize_groups(weight(64, 96), bits)
    strided = tuple(g.T.contiguous().T for g in groups)
    assert not strided[0].is_contiguous()
    assert torch.equal(pack(strided, bits).data, pack(groups, bits).data)


def test_c_quantized_swiglu_matches_float64():
    gen = torch.Generator().manual_seed(2)
    w1, w3 = weight(64, 96, seed=3), weight(64, 96, seed=4)
    x = torch.randn(3, 96, generator=gen)
    for bits in (8, 4):
        got = linear(x, prepare_quant_swiglu(w1, w3, bits))
        gate = int8_rows(x) @ dequantize_groups(quantize_groups(w1, bits)).T
        up = int8_rows(x) @ dequantize_groups(quantize_groups(w3, bits)).T
        want = gate * torch.sigmoid(gate) * up
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("bits", [8, 4, "pairs", "meta-int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_nan_input_makes_its_rows_outputs_nan_and_no_others(bits: int | str, dtype: torch.dtype):
    """A NaN anywhere in a row's input (either half of a 32-value block, a later block) makes every output of
    that row NaN, as a float64 matmul's and the float tiles' (test_layer_ops), and leaves the other rows as
    they are alone: vmax and the horizontal max drop NaN lanes, and a NaN rounds to a finite integer, which
    had given the row finite outputs (on every AVX-512 build, and on AVX2 for most positions). Pair tiles
    are Meta's int8 output layer; meta-int4 Meta's int4 tiles, their input quantized over its own range."""
    gen = torch.Generator().manual_seed(7)
    w = weight(70, 96).to(dtype)
    groups = None
    if bits == "meta-int4":
        q = torch.randint(-8, 8, (70, 96), generator=gen, dtype=torch.int8)
        scales = torch.rand(70, 3, generator=gen) / 10 + 0.01
        w = (q.double().view(70, 3, 32) * scales.double()[..., None]).view(70, 96)
        tiles = pack_tiles(Int4Weight((70, 96), 32, q, scales))
    elif bits == "pairs":
        tiles = pack_pairs(*quantize_groups(w, 8))
    else:
        groups = quantize_groups(w, bits)
        tiles = pack(groups, bits)
    for at in (0, 5, 17, 31, 40, 95):
        x = torch.randn(3, 96, generator=gen).to(dtype)
        x[1, at] = float("nan")
        got = linear(x, tiles)
        assert (x.double() @ w.double().T)[1].isnan().all()
        assert got[1].isnan().all(), f"NaN at {at}: the row's outputs are finite"
        assert torch.equal(got[[0, 2]], linear(x[[0, 2]], tiles)) and not got[[0, 2]].isnan().any()
        if groups is not None:
            want = int8_rows(x[[0, 2]]) @ dequantize_groups(groups).T
            tol = 1e-6 if dtype == torch.float32 else 2**-8
            torch.testing.assert_close(got[[0, 2]].double(), want, rtol=tol, atol=tol * want.abs().max().item())
