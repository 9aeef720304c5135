"""LoRA adapters per row in the C kernels (kernels/cpu/lora.c, and inside decode.c's layer halves) against
float64 written plainly, and each row's bits whatever rows share its step."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tp_llama.kernels import choose, prepare, prepare_swiglu
from tp_llama.kernels.cpu import ops
from tp_llama.kernels.cpu.build import runnable
from tp_llama.kernels.cpu.ffi import library
from tp_llama.lora.slots import block_lines

CPU = torch.device("cpu")
KIND = choose(CPU, torch.float32)[0]
pytestmark = pytest.mark.skipif(KIND not in ("amx", "tiles"),
                                reason="the C kernels need AVX2 or AVX-512 and a compiler (test_kernels checks that)")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
SLOTS = 4  # slot 0, the base, and three adapters


def slots(*rows: int) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def random_lora(gen: torch.Generator, rank: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a [SLOTS, rank, k] and bt [SLOTS, rank, n], deltas about as large as a weight's outputs: slot 0 is
    NaN (never read), slot 2 an adapter of half the rank (zeros past it)."""
    a = torch.randn(SLOTS, rank, k, generator=gen) / math.sqrt(k)
    bt = torch.randn(SLOTS, rank, n, generator=gen) / math.sqrt(rank)
    a[0], bt[0] = float("nan"), float("nan")
    a[2, rank // 2:], bt[2, rank // 2:] = 0, 0
    return a, bt


def delta(x: torch.Tensor, adapters: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """Each row's (x A_s^T) B_s^T in float64, zeros for the base's rows."""
    out = torch.zeros(x.shape[0], bt.shape[2], dtype=torch.float64)
    for m, s in enumerate(adapters.tolist()):
        if s:
            out[m] = (x[m].double() @ a[s].double().T) @ bt[s].double()
    return out


def scaled_tolerance(dtype: torch.dtype, expected: torch.Tensor) -> dict:
    tol = 2e-6 if dtype == torch.float32 else 2**-7
    return {"rtol": tol, "atol": tol * expected.abs().max().item()}


def fused_lora(gen: torch.Generator, rank: int, k: int, widths: list[int],
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused projection's parts' adapters stacked as lora/slots.py stacks them, in `dtype`: A along the
    rank, B^T block-diagonal (part j's ranks j * rank on, its columns after the parts before it)."""
    parts = [random_lora(gen, rank, k, n) for n in widths]
    bt = torch.zeros(SLOTS, rank * len(widths), sum(widths))
    for j, (_, part) in enumerate(parts):
        bt[:, j * rank : (j + 1) * rank, sum(widths[:j]) : sum(widths[: j + 1])] = part
    return torch.cat([a for a, _ in parts], dim=1).to(dtype), bt.to(dtype)


def unread_as_nan(bt: torch.Tensor, first: torch.Tensor, lines: int) -> torch.Tensor:
    """bt with NaN at every rank each 16 columns' lines leave out: what the kernel must never read."""
    out = bt.clone()
    for v, r0 in enumerate(first.tolist()):
        out[:, :r0, 16 * v : 16 * v + 16] = float("nan")
        out[:, r0 + lines :, 16 * v : 16 * v + 16] = float("nan")
    return out


@DTYPES
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["f32-weights", "bf16-weights"])
@pytest.mark.parametrize("rank", [8, 16, 48])
def test_lora_add_matches_float64(dtype: torch.dtype, weights: torch.dtype, rank: int):
    gen = torch.Generator().manual_seed(rank)
    k, n = 72, 50  # neither a multiple of 16: masked lanes on both passes
    a, bt = (t.to(weights) for t in random_lora(gen, rank, k, n))
    lora = ops.lora_weights(a, bt)
    adapters = slots(2, 0, 1, 2, 3, 0, 1, 2, 2)
    x = torch.randn(len(adapters), k, generator=gen).to(dtype)
    y = torch.randn(len(adapters), n, generator=gen).to(dtype)
    before = y.clone()
    ops.lora_add(x, adapters, lora, y)
    expected = before.double() + delta(x, adapters, a, bt)
    torch.testing.assert_close(y.double(), expected, **scaled_tolerance(dtype, expected))
    base = adapters == 0
    assert torch.equal(y[base], before[base])
    assert (y[~base] != before[~base]).float().mean() > 0.9


@DTYPES
def test_a_fused_projection_reads_only_its_blocks(dtype: torch.dtype):
    """q/k/v's block-diagonal B^T read by its blocks' lines (block_lines): the float64 delta, the bits of
    reading every rank, and the same with NaN everywhere the lines leave out."""
    gen = torch.Generator().manual_seed(9)
    k, rank, widths = 64, 8, {"wq": (64, 64), "wk": (64, 32), "wv": (64, 32)}
    a, bt = fused_lora(gen, rank, k, [n for _, n in widths.values()], dtype)
    lines = block_lines("qkv", widths, rank, None)
    adapters = slots(1, 0, 3, 2, 1)
    x = torch.randn(len(adapters), k, generator=gen).to(dtype)
    y = torch.randn(len(adapters), bt.shape[2], generator=gen).to(dtype)
    every, only, unread = y.clone(), y.clone(), y.clone()
    ops.lora_add(x, adapters, ops.lora_weights(a, bt), every)
    ops.lora_add(x, adapters, ops.lora_weights(a, bt, *lines), only)
    ops.lora_add(x, adapters, ops.lora_weights(a, unread_as_nan(bt, *lines), *lines), unread)
    assert torch.equal(only, every) and torch.equal(unread, every)
    expected = y.double() + delta(x, adapters, a, bt)
    torch.testing.assert_close(only.double(), expected, **scaled_tolerance(dtype, expected))
    assert (lines[0].tolist(), lines[1]) == ([0] * 4 + [8] * 2 + [16] * 2, 8)
    with pytest.raises(ValueError, match="runs of ranks"):
        ops.lora_weights(a, bt, torch.tensor([0] * 7 + [17]), 8)


def test_a_slot_written_again_is_read_again():
    """lora_retile: the C kernels' copy of a slot follows what is written into bt."""
    gen = torch.Generator().manual_seed(4)
    a, bt = random_lora(gen, 8, 32, 40)
    lora = ops.lora_weights(a, bt)
    x, adapters = torch.randn(2, 32, generator=gen), slots(1, 3)
    bt[3] = torch.randn(8, 40, generator=gen)
    ops.lora_retile(lora, 3)
    y = torch.zeros(2, 40)
    ops.lora_add(x, adapters, lora, y)
    torch.testing.assert_close(y.double(), delta(x, adapters, a, bt), rtol=2e-6, atol=1e-6)


@DTYPES
def test_lora_add_keeps_each_rows_bits_in_any_batch(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(5)
    k, n = 96, 70
    lora = ops.lora_weights(*random_lora(gen, 16, k, n))
    adapters = slots(1, 3, 0, 1, 2, 2, 1, 3, 1, 0, 2)
    x = torch.randn(len(adapters), k, generator=gen).to(dtype)
    y = torch.randn(len(adapters), n, generator=gen).to(dtype)
    together = y.clone()
    ops.lora_add(x, adapters, lora, together)
    for rows in [[m] for m in range(len(adapters))] + [[4, 0, 7], list(range(10, -1, -1))]:
        alone = y[rows].clone()
        ops.lora_add(x[rows].contiguous(), adapters[rows].contiguous(), lora, alone)
        assert torch.equal(alone, together[rows]), rows


def test_bad_adapters_are_refused():
    gen = torch.Generator().manual_seed(2)
    lora = ops.lora_weights(*random_lora(gen, 8, 32, 16))
    x, y = torch.randn(3, 32), torch.zeros(3, 16)
    for bad in (slots(0, 1, SLOTS), slots(0, -1, 1)):
        with pytest.raises(ValueError, match="adapter slots lie in 0 .. 3"):
            ops.lora_add(x, bad, lora, y)
    with pytest.raises(ValueError, match="int32 adapter slots"):
        ops.lora_add(x, slots(0, 1, 2).long(), lora, y)
    with pytest.raises(ValueError, match="do not fit adapters"):
        ops.lora_add(x, slots(0, 1, 2), lora, torch.zeros(3, 17))
    with pytest.raises(ValueError, match="of one type"):
        ops.lora_weights(torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(2, 4, 8))


def rotate(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Meta's RoPE in float64: element pairs (a, b) turned by (cos, sin) [hd / 2, 2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = cos_sin.double().unbind(-1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight.double()


def gate_tile_order(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., ffn] gate and up columns as the gated tiles order them: tile t holds gate columns
    16t .. 16t + 15, then up's."""
    run = library().constants["GATE_RUN"]
    return torch.stack([gate.unflatten(-1, (-1, run)), up.unflatten(-1, (-1, run))], dim=-2).flatten(-3)


class Layer:
    """One small GQA layer in the C kernels' tiles with adapters on every projection, its rows each in
    blocks of their own scattered over a paged cache, and the same layer op by op in float64. The adapters
    are as the engine holds them: in the layer's type, q/k/v's and w1/w3's stacked, the C kernels' copies
    NaN off the lines they read."""

    DIM, HEADS, KV, HD, FFN, BLOCK, RANK, EPS = 128, 4, 2, 32, 160, 16, 8, 1e-5
    POSITIONS = (5, 20, 0, 33, 16)

    def __init__(self, dtype: torch.dtype, bits: int = 16, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        dim, ffn, attn = self.DIM, self.FFN, self.HEADS * self.HD
        qkv = attn + 2 * self.KV * self.HD
        shapes = {"wqkv": (qkv, dim), "wo": (dim, attn), "w1": (ffn, dim), "w3": (ffn, dim), "w2": (dim, ffn)}
        self.w = {name: (torch.randn(shape, generator=gen) / math.sqrt(shape[1])).to(dtype)
                  for name, shape in shapes.items()}
        self.norms = tuple((1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype) for _ in range(2))
        kv, r = self.KV * self.HD, self.RANK
        self.lora = {"wqkv": fused_lora(gen, r, dim, [attn, kv, kv], dtype),
                     "w13": fused_lora(gen, r, dim, [ffn, ffn], dtype),
                     **{name: tuple(t.to(dtype) for t in random_lora(gen, r, k, n)) for name, (n, k) in shapes.items()
                        if name in ("wo", "w2")}}
        a13, bt13 = self.lora["w13"]
        self.lora["w1"], self.lora["w3"] = (a13[:, :r], bt13[:, :r, :ffn]), (a13[:, r:], bt13[:, r:, ffn:])
        self.lines = {"wqkv": block_lines("qkv", {"wq": (dim, attn), "wk": (dim, kv), "wv": (dim, kv)}, r, None),
                      "w13": block_lines("w13", {"w1": (dim, ffn), "w3": (dim, ffn)}, r,
                                         library().constants["GATE_RUN"])}
        rows, per_row = len(self.POSITIONS), -(-max(self.POSITIONS) // self.BLOCK) + 1
        n_blocks = rows * per_row + 1
        self.tables = torch.randperm(n_blocks, generator=gen)[:rows * per_row].view(rows, per_row)
        self.positions = torch.tensor(self.POSITIONS)
        angles = torch.rand(rows, self.HD // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
        self.rotation = torch.stack((angles.cos(), angles.sin()), dim=-1).float()
        self.cache0 = [torch.randn(self.KV, n_blocks * self.BLOCK, self.HD, generator=gen).to(dtype) for _ in range(2)]
        self.cache = [c.clone() for c in self.cache0]
        self.h = torch.randn(rows, dim, generator=gen).to(dtype)
        kind = choose(CPU, dtype)[0]
        self.weights = weights = (  # held: the layer's structs hold only their addresses
            prepare(self.w["wqkv"], kind, bits=bits), prepare(self.w["wo"], kind, bits=bits),
            prepare_swiglu(self.w["w1"], self.w["w3"], kind, bits), prepare(self.w["w2"], kind, bits=bits))
        bt13 = gate_tile_order(bt13[..., :ffn], bt13[..., ffn:])
        adapters = (ops.lora_weights(self.lora["wqkv"][0], unread_as_nan(self.lora["wqkv"][1], *self.lines["wqkv"]),
                                     *self.lines["wqkv"]),
                    ops.lora_weights(*self.lora["wo"]),
                    ops.lora_weights(a13, unread_as_nan(bt13, *self.lines["w13"]), *self.lines["w13"]),
                    ops.lora_weights(*self.lora["w2"]))
        self.c = ops.decode_layer(self.norms, weights, *self.cache, self.BLOCK, self.EPS, lora=adapters)
        self.plain = ops.decode_layer(self.norms, weights, *self.cache, self.BLOCK, self.EPS)
        assert self.c is not None and self.plain is not None

    def run(self, rows: list[int], adapters: torch.Tensor | None, stack: bool = False, with_lora: bool = True):
        """(attention half's delta, h after the FFN half's add, FFN half's delta, cache k, cache v) of these
        rows alone, from the cache as it started; stack: decode_stack's h too."""
        for live, start in zip(self.cache, self.cache0):
            live.copy_(start)
        layer = self.c if with_lora else self.plain
        h = self.h[rows].clone()
        held = (self.rotation[rows].contiguous(), self.tables[rows].contiguous(), self.positions[rows].contiguous())
        step = ops.decode_rows(*held, adapters)  # `held` alive for the calls, which read the rows' tensors
        scratch = ops.decode_scratch([layer], len(rows))
        attn, out = torch.empty_like(h), torch.empty_like(h)
        ops.attention_block(layer, step, h, None, attn, scratch, self.cache[0])
        ops.ffn_block(layer, h, attn, out, scratch, adapters)
        got = (attn, h, out, *(c.clone() for c in self.cache))
        if not stack:
            return got
        for live, start in zip(self.cache, self.cache0):
            live.copy_(start)
        h = self.h[rows].clone()
        ops.decode_stack(ops.decode_layers([layer]), step, h, scratch, self.cache[0])
        return (*got, h)

    def expected(self, adapters: torch.Tensor):
        """run's outputs for every row, in float64."""
        w = {name: t.double() for name, t in self.w.items()}
        k, v = (c.double() for c in self.cache0)
        h = self.h.double()
        x = rms(h, self.norms[0], self.EPS)
        qkv = (x @ w["wqkv"].T + delta(x, adapters, *self.lora["wqkv"])).unflatten(-1, (-1, self.HD))
        outs = []
        for r, (table, pos) in enumerate(zip(self.tables.tolist(), self.positions.tolist())):
            where = [table[p // self.BLOCK] * self.BLOCK + p % self.BLOCK for p in range(pos + 1)]
            q = rotate(qkv[r, :self.HEADS], self.rotation[r])
            k[:, where[pos]] = rotate(qkv[r, self.HEADS:self.HEADS + self.KV], self.rotation[r])
            v[:, where[pos]] = qkv[r, self.HEADS + self.KV:]
            keys, values = (t[:, where].repeat_interleave(self.HEADS // self.KV, dim=0) for t in (k, v))
            weights = torch.softmax(q.unsqueeze(1) @ keys.transpose(1, 2) / math.sqrt(self.HD), dim=-1)
            outs.append((weights @ values).flatten())
        out = torch.stack(outs)
        attn = out @ w["wo"].T + delta(out, adapters, *self.lora["wo"])
        h = h + attn
        x = rms(h, self.norms[1], self.EPS)
        gate = x @ w["w1"].T + delta(x, adapters, *self.lora["w1"])
        up = x @ w["w3"].T + delta(x, adapters, *self.lora["w3"])
        g = gate / (1 + torch.exp(-gate)) * up
        return attn, h, g @ w["w2"].T + delta(g, adapters, *self.lora["w2"]), k, v


@DTYPES
def test_a_decode_layer_with_adapters_matches_float64(dtype: torch.dtype):
    layer = Layer(dtype)
    adapters = slots(1, 0, 2, 3, 1)
    got = layer.run(list(range(5)), adapters)
    want = layer.expected(adapters)
    for name, g, e in zip(("attention", "h", "ffn", "cache k", "cache v"), got, want):
        tol = 1e-5 if dtype == torch.float32 else 1.5e-2
        torch.testing.assert_close(g.double(), e, rtol=tol, atol=tol * e.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")
    base = layer.run(list(range(5)), None)
    adapted = adapters != 0
    assert not torch.equal(got[2][adapted], base[2][adapted])  # the deltas are there to be missed


@pytest.mark.parametrize(("dtype", "bits"), [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 8)],
                         ids=["f32", "bf16", "int8"])
def test_base_rows_get_the_bits_of_a_step_without_adapters(dtype: torch.dtype, bits: int):
    """Rows all on slot 0 take the adapted path (w1/w3 ungated, SwiGLU after) and must still get the
    gated tiles' bits, as a step without adapters and a layer without any do."""
    layer = Layer(dtype, bits)
    rows = list(range(5))
    without = layer.run(rows, None, stack=True, with_lora=False)
    for adapters, with_lora in ((None, True), (slots(0, 0, 0, 0, 0), True), (slots(0, 0, 0, 0, 0), False)):
        for g, w in zip(layer.run(rows, adapters, stack=True, with_lora=with_lora), without):
            assert torch.equal(g, w)


@pytest.mark.parametrize(("dtype", "bits"), [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 8)],
                         ids=["f32", "bf16", "int8"])
def test_rows_on_adapters_keep_their_bits_alone_and_together(dtype: torch.dtype, bits: int):
    layer = Layer(dtype, bits)
    adapters = slots(2, 1, 0, 1, 3)
    together = layer.run(list(range(5)), adapters, stack=True)
    assert torch.equal(together[5], together[1] + together[2])  # decode_stack passes the rows' adapters on
    for rows in ([0], [1], [2], [3], [4], [3, 1], [4, 0, 2]):
        alone = layer.run(rows, adapters[rows].contiguous(), stack=True)
        for g, w in zip(alone[:3] + alone[5:], together[:3] + together[5:]):
            assert torch.equal(g, w[rows]), rows


def test_adapters_must_fit_their_weights():
    layer = Layer(torch.float32)
    weights = (prepare(layer.w["wqkv"], KIND), prepare(layer.w["wo"], KIND),
               prepare_swiglu(layer.w["w1"], layer.w["w3"], KIND), prepare(layer.w["w2"], KIND))
    wrong = ops.lora_weights(*layer.lora["wqkv"])
    with pytest.raises(ValueError, match="wo's adapters map 128 -> 256"):
        ops.decode_layer(layer.norms, weights, *layer.cache, layer.BLOCK, layer.EPS, lora=(None, wrong, None, None))


def test_the_lesser_builds_pass_these_tests():
    """The builds this CPU runs beside the loaded one, this module again in a process that loads each."""
    others = [v for v in runnable() if v != library().variant]
    if os.environ.get("TP_LLAMA_KERNELS") or not others:
        pytest.skip("one build runs here (or this run forces one): the main run tests it")
    for variant in others:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                                 __file__], cwd=Path(__file__).parents[1], capture_output=True, text=True,
                                timeout=600, check=False, env={**os.environ, "TP_LLAMA_KERNELS": variant})
        assert result.returncode == 0, f"{variant}: {result.stdout[-4000:]}"
