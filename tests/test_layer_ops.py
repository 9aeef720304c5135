"""The C layer ops (kernels/cpu/layer.c and decode.c through ops.py, the modules of tp_llama.backend.cpu)
against float64 written plainly."""

from __future__ import annotations

import math

import pytest
import torch

from tp_llama import backend
from tp_llama.kernels import choose, linear, prepare_swiglu
from tp_llama.kernels.cpu import ops
from tp_llama.model import Batch
from tests.support.run_model import setup_slots, slot_batch, steps_in_c_and_op_by_op

pytestmark = pytest.mark.skipif(choose(torch.device("cpu"), torch.float32)[0] not in ("amx", "tiles"),
                                reason="the C kernels need AVX2 or AVX-512 and a compiler (test_kernels checks they load here)")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2**-7


@DTYPES
def test_rms_norm_matches_float64(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    for rows, dim in ((1, 64), (3, 1000), (70, 1000), (5, 4096)):  # 70 x 1000 runs on every thread
        x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
        weight = torch.randn(dim, generator=gen).to(dtype)
        expected = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * weight.double()
        got = ops.rms_norm(x, weight, 1e-5)
        assert got.dtype == dtype and got.shape == x.shape
        tol = tolerance(dtype)
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@DTYPES
def test_gated_matmul_gives_swiglu_of_w1_and_w3(dtype: torch.dtype):
    """silu(x w1^T) * (x w3^T) from one tiled weight, decode sizes and prefill blocks (and the GEMM's, float32)."""
    gen = torch.Generator().manual_seed(1)
    for ffn, dim in ((16, 64), (96, 250), (2816, 512)):
        w1, w3 = (torch.randn(ffn, dim, generator=gen).div(dim**0.5).to(dtype) for _ in range(2))
        gated = prepare_swiglu(w1, w3, "tiles")
        assert gated.gated and gated.shape == (2 * ffn, dim)
        for rows in (1, 3, 8, 13, 70, 300):
            x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
            gate, up = x.double() @ w1.double().T, x.double() @ w3.double().T
            expected = gate / (1 + torch.exp(-gate)) * up
            got = linear(x, gated)
            assert got.shape == (rows, ffn) and got.dtype == dtype
            tol = tolerance(dtype)
            torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * expected.abs().max().item(),
                                       msg=lambda m: f"ffn={ffn} dim={dim} rows={rows}: {m}")


def test_gated_matmul_keeps_nan_in_its_row_and_refuses_odd_widths():
    w1, w3 = torch.randn(32, 64), torch.randn(32, 64)
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    got = linear(x, prepare_swiglu(w1, w3, "tiles"))
    assert got[1].isnan().all() and not got[[0, 2]].isnan().any()
    assert prepare_swiglu(torch.randn(24, 64), torch.randn(24, 64), "tiles") is None
    assert prepare_swiglu(w1, w3, "onednn") is None


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Meta's RoPE in float64: element pairs (a, b) turned by their angle. x [..., hd], angles [hd / 2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


BLOCK = 16


class Case:
    """A paged cache with random history and some decode rows, each in its own slot: a table of
    blocks scattered over the pool (a random permutation), so block lookups are exercised."""

    def __init__(self, dtype, heads, kv_heads, hd, slots, positions, max_seq_len=40, seed=0, window=None):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.hd, self.window = heads, kv_heads, hd, window
        per_slot = -(-max_seq_len // BLOCK)
        self.n_blocks = (max(slots) + 2) * per_slot
        shape = (kv_heads, self.n_blocks * BLOCK, hd)
        self.k = torch.randn(shape, generator=gen).to(dtype)
        self.v = torch.randn(shape, generator=gen).to(dtype)
        pool = torch.randperm(self.n_blocks, generator=gen)
        self.tables = torch.stack([pool[s * per_slot : (s + 1) * per_slot] for s in slots])
        self.positions = torch.tensor(positions)
        rows = len(slots)
        self.qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=gen).to(dtype)
        self.angles = torch.rand(rows, hd // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
        self.rotation = torch.stack((self.angles.cos(), self.angles.sin()), dim=-1).float().unsqueeze(1)

    def call(self, qkv, rotation, tables, positions, k, v, out) -> None:
        rows = ops.decode_rows(rotation.contiguous(), tables.contiguous(), positions.contiguous())
        ops.decode_attention(qkv, rows, k, v, BLOCK, out, window=self.window)

    def run(self, rows=slice(None)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, v = self.k.clone(), self.v.clone()
        qkv = self.qkv[rows].contiguous()
        out = qkv.new_empty((qkv.shape[0], self.heads * self.hd))
        self.call(qkv, self.rotation[rows], self.tables[rows], self.positions[rows], k, v, out)
        return out, k, v

    def expected(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output, cache k and v, all float64."""
        k, v = self.k.double(), self.v.double()
        heads, kv_heads, hd = self.heads, self.kv_heads, self.hd
        qkv = self.qkv.double().unflatten(-1, (-1, hd))
        outs = []
        for r, (table, pos) in enumerate(zip(self.tables.tolist(), self.positions.tolist())):
            first = pos - pos % self.window if self.window else 0  # Llama 4's chunk: keys from its start on
            where = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, pos + 1)]
            angles = torch.atan2(*self.rotation[r, 0].double().unbind(-1)[::-1])  # the angles the kernel is given
            q = rotate(qkv[r, :heads], angles)
            k[:, where[-1]] = rotate(qkv[r, heads : heads + kv_heads], angles)
            v[:, where[-1]] = qkv[r, heads + kv_heads :]
            keys = k[:, where].repeat_interleave(heads // kv_heads, dim=0)
            values = v[:, where].repeat_interleave(heads // kv_heads, dim=0)
            weights = torch.softmax(q.unsqueeze(1) @ keys.transpose(1, 2) / math.sqrt(hd), dim=-1)
            outs.append((weights @ values).flatten())
        return torch.stack(outs), k, v


SHAPES = [(4, 4, 64), (8, 2, 128), (6, 2, 64), (6, 3, 80), (2, 1, 16)]  # heads, kv_heads, head_dim


@DTYPES
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-hd{}".format(*s))
def test_decode_attention_matches_float64(dtype: torch.dtype, shape: tuple[int, int, int]):
    case = Case(dtype, *shape, slots=[3, 0, 5, 1], positions=[17, 0, 39, 16])
    out, k, v = case.run()
    want_out, want_k, want_v = case.expected()
    tol = tolerance(dtype)
    # bfloat16: q and k are rounded after RoPE, as the model's eager path rounds them
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=4 * tol)
    torch.testing.assert_close(k.double(), want_k, rtol=tol, atol=tol)
    assert torch.equal(v.double(), want_v)


@DTYPES
@pytest.mark.parametrize("window", [16, 32])
def test_decode_attention_in_a_window_matches_float64(dtype: torch.dtype, window: int):
    """Llama 4's chunked layers: a row sees only the keys from its window's first position on (rows at a
    window's first position, its last, and past the first window)."""
    case = Case(dtype, 8, 2, 64, slots=[3, 0, 5, 1, 2], positions=[17, 0, 39, 16, 31], window=window)
    out, k, _ = case.run()
    want_out, want_k, _ = case.expected()
    tol = tolerance(dtype)
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=4 * tol)
    torch.testing.assert_close(k.double(), want_k, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="not a multiple of the cache's 16-position blocks"):
        Case(dtype, 8, 2, 64, slots=[0], positions=[3], window=24).run()


@DTYPES
def test_decode_attention_row_gets_the_same_bits_in_any_batch(dtype: torch.dtype):
    case = Case(dtype, 8, 2, 64, slots=[2, 6, 0, 4, 1], positions=[5, 31, 0, 12, 39])
    out, _, _ = case.run()
    for rows in (slice(0, 1), slice(1, 2), slice(2, 5), slice(4, 5)):
        assert torch.equal(case.run(rows)[0], out[rows])


def test_decode_attention_keeps_nan_in_its_row():
    case = Case(torch.float32, 4, 2, 64, slots=[0, 1, 2], positions=[3, 4, 5])
    case.qkv[1, 7] = float("nan")
    out, _, _ = case.run()
    assert out[1].isnan().any() and not out[[0, 2]].isnan().any()


def test_decode_attention_rejects_rows_off_the_cache():
    case = Case(torch.float32, 4, 2, 64, slots=[0, 1], positions=[1, 2])  # tables of 3 blocks in a pool of 9
    before = case.k.clone()
    out = torch.empty(2, 4 * 64)
    good = case.tables.clone()
    off_pool = good.clone()
    off_pool[1, 0] = case.n_blocks
    negative = good.clone()
    negative[0, 0] = -1
    for tables, positions in ((good, [1, 48]), (good, [-1, 2]), (off_pool, [1, 2]), (negative, [1, 2])):
        with pytest.raises(IndexError, match="outside its block table or the KV cache"):
            case.call(case.qkv, case.rotation, tables, torch.tensor(positions), case.k, case.v, out)
        assert torch.equal(case.k, before)
    unused = good.clone()
    unused[1, 2] = case.n_blocks  # a bad entry past the row's position is never read
    case.call(case.qkv, case.rotation, unused, torch.tensor([1, 20]), case.k, case.v, out)


@DTYPES
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-hd{}".format(*s))
def test_prompt_rows_rope_and_cache_write_match_float64(dtype: torch.dtype, shape: tuple[int, int, int]):
    heads, kv_heads, hd = shape
    case = Case(dtype, heads, kv_heads, hd, slots=[0, 1, 2, 3], positions=[0, 1, 2, 3])
    locations = torch.tensor([5, 0, 63, 17])
    qkv, k, v = case.qkv.clone(), case.k.clone(), case.v.clone()
    ops.rope_prompt_rows(qkv, case.rotation, locations, heads, k, v)
    angles = torch.atan2(*case.rotation[:, 0].double().unbind(-1)[::-1])  # [rows, hd / 2]
    heads_in = case.qkv.double().unflatten(-1, (-1, hd))
    want_qk = torch.stack([rotate(heads_in[r, : heads + kv_heads], angles[r]) for r in range(4)])
    want_k, want_v = case.k.double(), case.v.double()
    want_k[:, locations] = want_qk[:, heads:].transpose(0, 1)
    want_v[:, locations] = heads_in[:, heads + kv_heads :].transpose(0, 1)
    tol = tolerance(dtype)
    torch.testing.assert_close(qkv.double().unflatten(-1, (-1, hd))[:, : heads + kv_heads], want_qk, rtol=tol, atol=tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * hd :], case.qkv[:, (heads + kv_heads) * hd :])
    torch.testing.assert_close(k.double(), want_k, rtol=tol, atol=tol)
    assert torch.equal(v.double(), want_v)


def test_prompt_rows_off_the_cache_are_refused_before_any_write():
    case = Case(torch.float32, 4, 2, 64, slots=[0, 1], positions=[0, 1])
    for bad in ([3, case.k.shape[1]], [-1, 3]):
        qkv, k = case.qkv.clone(), case.k.clone()
        with pytest.raises(IndexError, match="outside the KV cache"):
            ops.rope_prompt_rows(qkv, case.rotation, torch.tensor(bad), 4, k, case.v.clone())
        assert torch.equal(qkv, case.qkv) and torch.equal(k, case.k)
    with pytest.raises(ValueError, match="2 rows need 2 locations"):
        ops.rope_prompt_rows(case.qkv.clone(), case.rotation[:1], torch.tensor([0, 1]), 4, case.k.clone(), case.v.clone())


def served_model(dtype: torch.dtype, max_seq_len: int, quantized: str = "none") -> torch.nn.Module:
    """A small GQA Llama 3.1 model (the same weights every call) with 4 cache slots, prepared for serving
    (its matmul weights quantized, or not)."""
    from tp_llama.model import Transformer
    from tp_llama.model import ModelArgs

    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=96, family="llama3",
                     rope_theta=500000.0, use_scaled_rope=True)
    model = Transformer(args).to(dtype)
    assert backend.optimize(model, quantized=quantized)[0] in ("amx", "tiles")
    setup_slots(model, 4, max_seq_len, dtype, torch.device("cpu"))
    return model


@pytest.mark.parametrize("quantized", ["none", "int4"])
@torch.inference_mode()
def test_bfloat16_rows_get_the_same_bits_alone_and_batched(quantized: str):
    """With the C kernels every op of a step is per row (or per output over k in a fixed order; a
    quantized matmul's input quantized per row), so a bfloat16 row's logits do not depend on what
    shares its step."""
    together, alone = (served_model(torch.bfloat16, 64, quantized) for _ in range(2))  # rows together, each alone
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (9, 4, 15)]
    rows = [(slot, 0, ids, True) for slot, ids in enumerate(prompts)]

    def compare(rows):
        batched = together(slot_batch(together, rows))
        for row, logits in zip(rows, batched):
            assert torch.equal(alone(slot_batch(alone, [row]))[0], logits)
        return batched.argmax(-1).tolist()

    picked = compare(rows)  # three prompts prefilled in one step
    for step in range(3):  # decode steps; the last one beside a fourth prompt's prefill
        rows = [(slot, len(prompts[slot]) + step, [picked[slot]], True) for slot in range(3)]
        if step == 2:
            rows.append((3, 0, prompts[0][:6], True))
        picked = compare(rows)


@DTYPES
@pytest.mark.parametrize("quantized", ["none", "int8", "int4"])
@torch.inference_mode()
def test_layers_in_c_give_the_op_by_op_bits(dtype: torch.dtype, quantized: str):
    """decode.c runs a decode-only step's layers as two C calls each, and the FFN halves of a step with
    prompt rows (on AMX, SwiGLU's outputs handed to w2 packed), on float or quantized tiles; logits and
    cache writes must be the bits of the op-by-op path (itself checked against float64 by the parity
    and quantization tests)."""
    model = served_model(dtype, 64, quantized)
    in_c_layers = model.layers
    assert in_c_layers._structs() is not None and len(in_c_layers._structs()) == 2
    steps_in_c_and_op_by_op(model, 97)
    caches = [t for layer in model.layers for t in (layer.attention.cache.k, layer.attention.cache.v)]
    before = [t.clone() for t in caches]
    cache = model.layers[0].attention.cache
    with pytest.raises(IndexError, match="outside its block table or the KV cache"):  # a block past the pool
        model(Batch.build([(5, [1], True, [0]), (5, [1], True, [cache.spare + 1])], BLOCK, cache.spare,
                          torch.device("cpu")))
    assert all(torch.equal(a, b) for a, b in zip(before, caches))
