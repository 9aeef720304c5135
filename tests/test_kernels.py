"""The CPU matmul kernels (tp_llama/kernels, kernels/cpu/matmul.c) against a float64 matmul, and their build."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.compilers import unoptimised_compiler
from tp_llama.kernels import Tiled, choose, linear, onednn, prepare, prepare_swiglu
from tp_llama.kernels.cpu import build as cpu_build
from tp_llama.kernels.cpu import ffi, ops
from tp_llama.kernels.cpu.build import COMMON_FLAGS, HERE, VARIANTS, build, runnable
from tp_llama.kernels.cpu.ffi import amx_ready, library
from tp_llama.pages import HUGE_PAGE

CPU = torch.device("cpu")
COMPILER = shutil.which("gcc") or shutil.which("cc")
HAS_COMPILER = COMPILER is not None
VARIANT = os.environ.get("TP_LLAMA_KERNELS") or next(iter(runnable()), None)  # the build these tests load
TILES = HAS_COMPILER and VARIANT is not None
AMX = TILES and VARIANT == "avx512-amx"
NEEDS_TILES = pytest.mark.skipif(not TILES, reason="needs a build of the C kernels: AVX2 or AVX-512, and a C compiler")
REPO = Path(__file__).resolve().parents[1]
# Tests whose outcome does not depend on the build loaded: the reruns per lesser build leave them out.
ANY_BUILD = pytest.mark.any_build


def available_kinds(dtype: torch.dtype) -> list[str]:
    """The matmul kinds this CPU can run in `dtype`: "plain" always, oneDNN where it packs the dtype
    (not bfloat16 on AVX2-only CPUs, whose engines fall back to "plain"), the tiles where built."""
    kinds = ["plain"]
    if onednn.available(dtype):
        kinds.append("onednn")
    kind = choose(CPU, torch.float32)[0]
    if kind in ("amx", "tiles"):
        kinds.append("tiles")
    if kind == "amx":
        kinds.append("amx")
    return kinds


def test_avx2_and_avx512_cpus_get_the_tiled_kernel():
    """Where it can run it must: a build that broke would otherwise fall back unnoticed."""
    if not TILES:
        pytest.skip("no AVX2 or no C compiler here: the fallback is what runs")
    for dtype in (torch.float32, torch.bfloat16):
        assert choose(CPU, dtype) == ("amx" if AMX else "tiles", "")
    assert amx_ready() == AMX
    assert library().variant == VARIANT


FULL = ("kernels", "quant_kernels", "layer_ops", "sampling", "batch_invariance")
INVARIANCE = "tests/test_batch_invariance.py"


def rerun(modules: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Test modules again in a process of their own, with `env` added to this one's."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "-m", "not any_build", *modules],
                          cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=600,
                          check=False)


@pytest.mark.parametrize(("variant", "names", "least"), [
    ("avx512-vnni", ("quant_kernels", "batch_invariance"), 22),  # it differs from avx512 in quantized dot products
    ("avx512-bf16", FULL, 73), ("avx512", FULL, 73), ("avx2", FULL, 73),
    ("avx2-vnni", ("quant_kernels", "batch_invariance"), 22),  # it differs from avx2 in quantized dot products
])
def test_the_lesser_builds_pass_the_kernel_tests(variant: str, names: tuple[str, ...], least: int):
    """A CPU runs the builds for less than it has, so those are tested here too (AVX-512 BF16's for AMD's
    Zen 4 and 5, AVX-512 VNNI's for Intel's Cascade Lake and Ice Lake, plain AVX-512 for Skylake-SP, AVX2
    for AMD's Zen 2/3, AVX-VNNI's for Intel from Alder Lake and Sapphire Rapids on): these modules again,
    in a process that loads the build (TP_LLAMA_KERNELS), less the tests marked ANY_BUILD.
    test_decode_step is left out: its models run plain matmuls, and its compiled runs took 50 s of each
    rerun."""
    if os.environ.get("TP_LLAMA_KERNELS"):
        pytest.skip("a run with a forced build tests that build alone")
    if not HAS_COMPILER or variant not in runnable() or variant == VARIANT:
        pytest.skip(f"needs a compiler and a CPU beyond {variant} (where it is the best, the main run tests it)")
    result = rerun([f"tests/test_{name}.py" for name in names], {"TP_LLAMA_KERNELS": variant})
    assert result.returncode == 0, result.stdout[-4000:]
    assert int(re.search(r"(\d+) passed", result.stdout).group(1)) >= least, result.stdout[-1000:]


@ANY_BUILD
def test_batch_invariance_holds_with_atens_kernels_held_to_avx2():
    """Paths that go through PyTorch (its SDPA, its elementwise ops) pick kernels by ATen's CPU
    capability: the invariance tests again with it held to AVX2, where ATen would pick more."""
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("ATen runs its AVX2 kernels here already: the main run is this case")
    result = rerun([INVARIANCE], {"ATEN_CPU_CAPABILITY": "avx2"})
    assert result.returncode == 0, result.stdout[-4000:]



@ANY_BUILD
def test_each_cpu_gets_the_best_variant_it_can_run():
    """The choice from CPU flags alone (faked here, so it is checked on any machine)."""
    avx512 = {"avx512f", "avx512bw", "avx512vl", "fma", "f16c", "avx2"}
    amx = {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}  # every AMX CPU so far has these too
    lesser = ["avx512-vnni", "avx512", "avx2"]
    assert runnable(avx512 | amx) == ["avx512-amx", "avx512-bf16", *lesser]
    assert runnable(avx512 | {"avx512_bf16", "avx512_vnni"}) == ["avx512-bf16", *lesser]  # AMD's Zen 4 and 5
    assert runnable(avx512 | {"avx512_vnni"}) == lesser  # Intel's Cascade Lake and Ice Lake
    assert runnable(avx512) == ["avx512", "avx2"]  # Intel's Skylake-SP
    assert runnable(avx512 | {"amx_tile"}) == ["avx512", "avx2"]  # AMX without its bfloat16 unit
    assert runnable(avx512 | amx - {"avx512_bf16"}) == lesser  # the AMX build's attention pairs bf16 keys
    assert runnable({"avx2", "fma", "f16c", "avx_vnni"}) == ["avx2-vnni", "avx2"]  # Intel's Alder Lake on
    assert runnable({"avx2", "fma", "f16c"}) == ["avx2"]  # AMD's Zen 2/3
    assert runnable({"avx2", "fma"}) == []  # no F16C: the quantized tiles' fp16 scales need it
    assert runnable({"avx2"}) == runnable({"sse4_2", "fma"}) == []


@ANY_BUILD
def test_amd_cpus_prefetch_the_next_tile_only_for_several_chunks_of_rows(monkeypatch):
    """The vendor picks it (faked here), TP_LLAMA_NEXT_TILE_MIN_CHUNKS overrides it, and nonsense is refused."""
    monkeypatch.delenv("TP_LLAMA_NEXT_TILE_MIN_CHUNKS", raising=False)
    assert ffi.next_tile_min_chunks("AuthenticAMD") == 2
    assert ffi.next_tile_min_chunks("GenuineIntel") == ffi.next_tile_min_chunks("") == 1
    monkeypatch.setenv("TP_LLAMA_NEXT_TILE_MIN_CHUNKS", "1")
    assert ffi.next_tile_min_chunks("AuthenticAMD") == 1
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("TP_LLAMA_NEXT_TILE_MIN_CHUNKS", bad)
        with pytest.raises(ValueError, match="TP_LLAMA_NEXT_TILE_MIN_CHUNKS"):
            ffi.next_tile_min_chunks("GenuineIntel")
    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert cpu_build.cpu_vendor() in ("GenuineIntel", "AuthenticAMD")


@NEEDS_TILES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_tiles_give_the_same_bits_with_and_without_the_next_tiles_prefetch(dtype: torch.dtype):
    """Both settings run (one per CPU vendor): each is checked against float64 and gives the same bits,
    at one chunk of rows, at several, and with a short last tile."""
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(200, 512, generator=gen) / 512**0.5).to(dtype)
    weight = prepare(w, "tiles")
    x = torch.randn(21, 512, generator=gen).to(dtype)
    lib = library()
    try:
        outs = []
        for chunks in (1, 1000):
            lib.set_next_tile_min_chunks(chunks)
            outs.append([linear(x[:rows], weight) for rows in (1, 5, 8, 21)])
    finally:
        lib.set_next_tile_min_chunks(lib.next_tile_min_chunks)
    product = x.double() @ w.double().T
    for asked, unasked in zip(*outs, strict=True):
        assert torch.equal(asked, unasked)
        rows = asked.shape[0]
        torch.testing.assert_close(asked.double(), product[:rows], rtol=2**-7, atol=2**-7 * product.abs().max().item())


@pytest.mark.skipif(not AMX, reason="needs a CPU with AMX (amx_tile, amx_bf16) and the kernels built for it")
@pytest.mark.parametrize(("gated", "in_features", "rows", "out_features"),
                         [(False, 96, 75, 130), (True, 128, 75, 96), (False, 2048, 300, 330), (True, 2048, 300, 544),
                          (False, 4160, 75, 130), (True, 4160, 75, 96), (False, 4160, 300, 330), (True, 4160, 300, 544),
                          (False, 16416, 40, 300)],
                         ids=["plain", "gated", "plain-chunks", "gated-chunks", "plain-pieces", "gated-pieces",
                              "plain-pieces-chunks", "gated-pieces-chunks", "one-block-panels"])
def test_amx_matmuls_match_float64_and_keep_each_rows_bits(gated: bool, in_features: int, rows: int,
                                                          out_features: int):
    """Every bfloat16 call runs on AMX from the same tiles: against float64 (to bfloat16's
    rounding), a ragged last tile, every row count around the 32-row blocks and the 16-row half;
    rows in chunks that fit L2's share, whole k at a time (300 x 2048: a chunk of 256 rows and a
    short one); k in pieces of 2,048 whose sums wait in memory between them (4160: two and a short
    one), in one chunk and in several. A call of one 32-row block takes whole k, but one block
    16,416 wide (more than L2 holds) meets panels of 8 tiles in k slabs of 2,048. Each block's
    epilogue runs during the next block's k steps, so the last one's is written
    at the end of a chunk or call. A row gets the same bits in any batch, one row alone included
    (what lets a seeded request draw the same tokens alone and batched)."""
    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    weight = prepare_swiglu(*w.chunk(2), "amx") if gated else prepare(w, "amx")
    assert weight.amx
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    product = x.double() @ w.double().T
    if gated:
        gate, up = product.chunk(2, dim=-1)
        product = gate / (1 + torch.exp(-gate)) * up
    full = linear(x, weight)
    torch.testing.assert_close(full.double(), product, rtol=2**-7, atol=2**-7 * product.abs().max().item())
    for part in (slice(0, 1), slice(7, 8), slice(2, 6), slice(3, 15), slice(0, 32), slice(5, 38), slice(40, 75)):
        assert torch.equal(linear(x[part], weight), full[part]), part


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Queries [T, heads, hd] at positions start .. against keys and values [start + T, kv_heads, hd],
    each query seeing those up to its own position: GQA attention written plainly, in float64."""
    rows, heads, head_dim = q.shape
    k, v = (t.double().repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / head_dim**0.5
    seen = torch.arange(k.shape[0]) <= start + torch.arange(rows).unsqueeze(1)
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(rows, heads * head_dim)


@NEEDS_TILES
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 64), (8, 2, 128), (4, 4, 64)],
                         ids=["llama3-1b", "head-dim-128", "no-gqa"])
def test_prompt_attention_matches_float64(heads: int, kv_heads: int, head_dim: int):
    """A prompt chunk in C (kernels/cpu/prompt_attention.c: AMX tiles, vdpbf16ps or FMAs, by the build)
    against a float64 causal softmax: chunks from position 0 and after earlier keys (a long prompt's
    later chunk, a cached prefix), keys and values read through a shuffled block table; one row, a
    ragged last 16-row block, an odd number of 16-key blocks, four and a rest, several 32-key steps;
    out and qkv row slices of wider tensors."""
    gen = torch.Generator().manual_seed(3)
    block_size, n_blocks = 16, 64
    width = (heads + 2 * kv_heads) * head_dim
    for start, rows in ((0, 1), (0, 5), (0, 17), (0, 33), (0, 200), (0, 513), (5, 1), (16, 40), (100, 150), (700, 3)):
        cache_k, cache_v = (torch.randn(kv_heads, (n_blocks + 1) * block_size, head_dim, generator=gen).bfloat16()
                            for _ in range(2))
        table = torch.randperm(n_blocks, generator=gen)
        positions = torch.arange(start + rows)
        at = table[positions // block_size] * block_size + positions % block_size
        qkv = torch.randn(rows, width + 32, generator=gen).bfloat16()[:, 16:16 + width]
        out = torch.full((rows, heads * head_dim + 64), 7.0, dtype=torch.bfloat16)
        mine = out[:, 32:32 + heads * head_dim]
        assert ops.prompt_attention(qkv, heads, head_dim, cache_k, cache_v, block_size, table, start, mine)
        q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
        expected = causal_attention(q, cache_k[:, at].transpose(0, 1), cache_v[:, at].transpose(0, 1), start)
        # the output's own rounding (8 bits) and the probabilities', rounded to bfloat16 before the values
        torch.testing.assert_close(mine.double(), expected, rtol=2**-7, atol=2**-7, msg=f"start {start}, {rows} rows")
        assert (out[:, :32] == 7).all() and (out[:, 32 + heads * head_dim:] == 7).all(), "wrote outside its rows"
    with pytest.raises(IndexError):
        ops.prompt_attention(qkv, heads, head_dim, cache_k, cache_v, block_size, torch.full((64,), n_blocks + 5), 0,
                             mine)
    with pytest.raises(IndexError):  # positions 700 .. 702 need block 43, past a table of 43 (the C call would read on)
        ops.prompt_attention(qkv, heads, head_dim, cache_k, cache_v, block_size, table[:43], 700, mine)
    qkv = torch.randn(4, (heads + 2 * kv_heads) * 32, generator=gen).bfloat16()
    out = torch.zeros(4, heads * 32, dtype=torch.bfloat16)
    cache = torch.zeros(kv_heads, 4 * block_size, 32, dtype=torch.bfloat16)
    assert not ops.prompt_attention(qkv, heads, 32, cache, cache, block_size, torch.arange(3), 0, out)
    assert not out.any(), "head_dim 32: left to flash attention, nothing written"


@pytest.mark.parametrize(("kind", "dtype"), [
    pytest.param(kind, dtype, id=f"{name}-{kind}")
    for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")) for kind in available_kinds(dtype)])
def test_linear_matches_float64(kind: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    for in_features in (32, 96, 250):
        for out_features in (1, 5, 64, 100, 130):
            weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
            prepared = prepare(weight, kind)
            for rows in (1, 2, 5, 6, 7, 8, 13, 33, 70, 300):
                x = torch.randn(rows, in_features, generator=gen).to(dtype)
                expected = x.double() @ weight.double().T
                got = linear(x, prepared)
                assert got.shape == (rows, out_features) and got.dtype == dtype
                # float32: summation order only; bfloat16: the output's own rounding (8 bits).
                tol = 1e-5 if dtype == torch.float32 else 2**-8
                scale = expected.abs().max().item()
                torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * scale,
                                           msg=f"{kind} rows={rows} out={out_features} in={in_features}")


@NEEDS_TILES
def test_tiled_layout_and_its_edges():
    weight = torch.randn(130, 96)
    tiled = prepare(weight, "tiles")
    assert isinstance(tiled, Tiled) and tiled.shape == (130, 96)
    assert tiled.data.shape == (5, 96, 32)  # 130 columns in five tiles of 32, the last padded
    # Leading dims are kept, a NaN stays in its own row, and an odd bfloat16 width falls back.
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)
    x[1, 2, 5] = float("nan")
    y = linear(x, prepare(weight.bfloat16(), "tiles"))
    assert y.shape == (2, 3, 130)
    assert y[1, 2].isnan().all() and not y[:1].isnan().any()
    assert not isinstance(prepare(torch.randn(8, 33, dtype=torch.bfloat16), "tiles"), Tiled)
    with pytest.raises(TypeError, match="bfloat16"):
        linear(torch.randn(1, 96, dtype=torch.bfloat16), tiled)


@pytest.mark.skipif(not AMX, reason="needs a CPU with AMX (amx_tile, amx_bf16) and the kernels built for it")
def test_amx_tiles_layout():
    """AMX's tiles, written out here by index: each 16 pairs of k (32 bfloat16) of a tile are two
    runs of 16 x 16 pairs, its columns 0-15 then 16-31, each run an AMX B operand read in one
    piece. A width that is not a multiple of 32 keeps the FMA tiles' layout (AMX refuses it)."""
    weight = torch.randn(40, 64).bfloat16()  # a ragged last tile: zeros past row 40
    units = torch.cat([weight.view(torch.int32), torch.zeros(24, 32, dtype=torch.int32)])
    expected = units.view(2, 2, 16, 2, 16).permute(0, 3, 1, 4, 2)  # [tile][half][c][s][q] -> [tile][s][half][q][c]
    tiled = prepare(weight, "amx")
    assert tiled.amx and torch.equal(tiled.data.view(torch.int32).flatten(), expected.flatten())
    x = torch.randn(3, 64).bfloat16()
    product = x.double() @ weight.double().T
    torch.testing.assert_close(linear(x, tiled).double(), product, rtol=2**-7, atol=2**-7 * product.abs().max().item())
    narrow = torch.randn(40, 42).bfloat16()
    assert torch.equal(prepare(narrow, "amx").data, prepare(narrow, "tiles").data)


@NEEDS_TILES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("out_features", [96, 32768], ids=["small", "huge-pages"])
def test_tiles_layout(dtype: torch.dtype, out_features: int):
    """out[t][k][c] = w[t * 32 + c][k], written out here by index; a width of 16 + 5 units
    crosses the packer's blocks of 16 and ends inside one. Tiles of 2 MiB or more start on a
    2 MiB boundary (tp_llama.pages) and multiply as the plain weight does."""
    weight = torch.randn(out_features, 42).to(dtype)
    units = weight.view(torch.int32)
    expected = torch.stack([units[t * 32:(t + 1) * 32].T for t in range(out_features // 32)])
    tiled = prepare(weight, "tiles")
    assert torch.equal(tiled.data.view(torch.int32), expected)
    assert tiled.data.nbytes < HUGE_PAGE if out_features == 96 else tiled.data.data_ptr() % HUGE_PAGE == 0
    x = torch.randn(3, 42).to(dtype)
    product = x.double() @ weight.double().T
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(linear(x, tiled).double(), product, rtol=tol, atol=tol * product.abs().max().item())
    rows = torch.randn(40, 42).to(dtype)  # not whole tiles: zeros past the last row
    ragged = prepare(rows, "tiles").data.view(torch.int32)
    assert ragged.shape == (2, units.shape[1], 32) and not ragged[1, :, 8:].any()


@NEEDS_TILES
def test_threads_split_columns_without_changing_results():
    weight = prepare(torch.randn(1000, 256), "tiles")
    x = torch.randn(9, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, weight)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(linear(x, weight), one)
    finally:
        torch.set_num_threads(threads)


def test_forced_kind_and_bad_values(monkeypatch):
    monkeypatch.setenv("TP_LLAMA_MATMUL", "plain")
    assert choose(CPU, torch.float32) == ("plain", "")
    if TILES:
        monkeypatch.setenv("TP_LLAMA_MATMUL", "tiles")  # the FMA tiles even where AMX runs
        assert choose(CPU, torch.bfloat16) == ("tiles", "")
    if TILES and not amx_ready():
        monkeypatch.setenv("TP_LLAMA_MATMUL", "amx")  # AMX it cannot have: the tiles, saying why
        kind, why = choose(CPU, torch.bfloat16)
        assert kind == "tiles" and why.startswith("TP_LLAMA_MATMUL=amx: "), why
    monkeypatch.setenv("TP_LLAMA_MATMUL", "onednn")
    assert choose(CPU, torch.float32)[0] == ("onednn" if torch.backends.mkldnn.is_available() else "plain")
    assert choose(CPU, torch.float32, traced=True)[0] == "plain"  # torch.compile cannot trace oneDNN's weights
    monkeypatch.setenv("TP_LLAMA_MATMUL", "fast")
    with pytest.raises(ValueError, match="TP_LLAMA_MATMUL"):
        choose(CPU, torch.float32)
    monkeypatch.setenv("TP_LLAMA_MATMUL", "")  # set but empty: as if unset
    assert choose(CPU, torch.float32)[0] == ("amx" if AMX else "tiles" if TILES else "onednn")
    monkeypatch.delenv("TP_LLAMA_MATMUL")
    assert choose(CPU, torch.float16) == ("plain", "")


def test_a_forced_build_and_bad_values(monkeypatch):
    ffi.load.cache_clear()
    try:
        monkeypatch.setenv("TP_LLAMA_KERNELS", "sse4")
        with pytest.raises(ValueError, match="TP_LLAMA_KERNELS='sse4': choose one of avx512-amx, avx512-bf16, avx512-vnni, avx512, avx2-vnni, avx2"):
            ffi.load()
        monkeypatch.setenv("TP_LLAMA_KERNELS", "")  # set but empty: as if unset, the best build this CPU runs
        lib, why = ffi.load()
        assert (lib.variant if lib else why) == (runnable()[0] if TILES else why)
    finally:
        monkeypatch.undo()
        ffi.load.cache_clear()


@ANY_BUILD
def test_a_failing_compiler_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_build, "_cache_dirs", lambda: [tmp_path])
    with pytest.raises(OSError, match="false failed"):
        build("avx512", ["false"])
    assert not list(tmp_path.glob("*.so"))


@ANY_BUILD
@pytest.mark.skipif(not HAS_COMPILER, reason="needs a C compiler")
def test_the_build_is_cached(monkeypatch, tmp_path):
    """The second build is the first's file, untouched; the first skips a cache folder it cannot make.
    Built at -O0 (tests/support/compilers.py): the cache is the point, not the optimised code."""
    monkeypatch.setattr(cpu_build, "_cache_dirs", lambda: [tmp_path / "unwritable", tmp_path / "cache"])
    (tmp_path / "unwritable").write_text("a file where the folder should be")
    cc = unoptimised_compiler(tmp_path, COMPILER)
    first = build("avx512", [cc])
    assert first.parent == tmp_path / "cache" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert build("avx512", [cc]) == first and first.stat().st_mtime_ns == stamp


@ANY_BUILD
@pytest.mark.skipif(not HAS_COMPILER, reason="needs a C compiler")
@pytest.mark.parametrize("variant", ["avx512-bf16", "avx2"])
@pytest.mark.parametrize(("source", "hint"), [
    ("layer.c", "prefetcht0"),  # attention's keys and values ahead of use
    ("matmul.c", "prefetcht1"),  # the next weight tile
])
def test_the_prefetches_survive_compilation(source: str, hint: str, variant: str):
    """gcc 12 deleted attention's prefetches (ipa-modref) without a word: the kernel ran 1.5x slower. The
    widest and the narrowest builds: `avx512` compiles avx512-bf16's code less its bfloat16 and VNNI dot products."""
    flags = [flag for flag in [*COMMON_FLAGS, *VARIANTS[variant][1]] if flag not in ("-shared", "-fPIC")]
    path = HERE / source
    listing = subprocess.run([COMPILER, *flags, "-S", "-o", "-", str(path)], check=True, capture_output=True,
                             text=True, timeout=120).stdout
    assert re.search(rf"^\s*{hint}\s", listing, re.M)


@NEEDS_TILES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_row_gets_the_same_bits_in_any_batch(dtype: torch.dtype):
    """Each output sums its products in k order whatever rows share the call, a prefill's hundreds
    included: batching is exact."""
    gen = torch.Generator().manual_seed(3)
    weight = prepare(torch.randn(200, 512, generator=gen).to(dtype), "tiles")
    x = torch.randn(300, 512, generator=gen).to(dtype)
    full = linear(x, weight)
    for rows in (slice(0, 1), slice(4, 5), slice(3, 12), slice(20, 21), slice(2, 19), slice(299, 300)):
        assert torch.equal(linear(x[rows], weight), full[rows])


@NEEDS_TILES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_a_prefills_hundreds_of_rows_match_float64(gated: bool, dtype: torch.dtype):
    """Calls of a prompt step's size run the tiles too, in blocks of rows that share a pass (on AVX2,
    bfloat16 ones a half tile at a time, a SwiGLU's gate half kept for its up half)."""
    gen = torch.Generator().manual_seed(2)
    out_features = 160 if gated else 130  # five tiles either way
    w = (torch.randn(out_features, 96, generator=gen) / 96**0.5).to(dtype)
    x = torch.randn(300, 96, generator=gen).to(dtype)
    product = x.double() @ w.double().T
    if gated:
        gate, up = product.chunk(2, dim=-1)
        expected = gate / (1 + torch.exp(-gate)) * up
        got = linear(x, prepare_swiglu(*w.chunk(2), "tiles"))
    else:
        expected, got = product, linear(x, prepare(w, "tiles"))
    tol = 1e-5 if dtype == torch.float32 else 2**-8  # bfloat16: the output's own rounding
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


AVX2_ONLY_ONEDNN = """
import sys, torch
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.kernels import choose
from tp_llama.testing.synthetic import write_checkpoint

print(choose(torch.device("cpu"), torch.bfloat16))
print(choose(torch.device("cpu"), torch.float32))
engine = Engine.load(EngineConfig(str(write_checkpoint(sys.argv[1])), "tp", "bfloat16", max_seq_len=64))
seq = Sequence("a", [1, 5, 9, 13], SamplingParams(4, ignore_eos=True))
engine.generate([seq])
print(len(seq.output))
"""


@ANY_BUILD
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
def test_bfloat16_loads_where_onednn_cannot_pack_it(tmp_path):
    """On AVX2-only CPUs (AMD Zen 2/3) PyTorch refuses to pack bfloat16 weights for oneDNN; such a
    process must load and serve with plain matmuls, saying why, not die at load. oneDNN capped at
    AVX2 (ONEDNN_MAX_CPU_ISA) stands in for such a CPU, with the C kernels forced off."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "TP_LLAMA_MATMUL": "onednn"}
    done = subprocess.run([sys.executable, "-c", AVX2_ONLY_ONEDNN, str(tmp_path / "ckpt")], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    bf16, f32, tokens = done.stdout.strip().splitlines()[-3:]
    assert bf16.startswith("('plain',") and "oneDNN packs no bfloat16 weights" in bf16
    assert f32.startswith("('onednn',")
    assert tokens == "4"
