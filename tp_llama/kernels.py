"""Matmuls on weights prepared once, at load, for the device that runs them, and the C layer ops.

Three kinds, picked per process by `matmul_kind` (TP_LLAMA_MATMUL forces one, for comparisons):

- "tiles", CPUs with AVX-512: cpu_matmul.c, built here with the system's C compiler on first
  use and cached. The weight is repacked into column tiles that stream once per call. On a
  bench model's weights (bench/bench_matmul.py) it takes 0.71-0.85x oneDNN's time at 1-32 rows
  in float32 and 0.52-0.80x at every row count in bfloat16, whose weights it widens to float32
  in registers rather than use vdpbf16ps. A SwiGLU's w1 and w3 go in one weight whose tiles
  end in silu(gate) * up (`prepare_swiglu`). float32 calls of MKL_ROWS rows or more go to
  MKL on the weight laid out plainly again, a slice at a time. The same library holds
  cpu_layer.c (rms_norm, decode_attention) and cpu_decode.c (a decode-only step's layers in one
  call, or one per half layer under TP), which the model uses with this kind only.
- "onednn", other CPUs: oneDNN's blocked layout, 15-35% faster than PyTorch's default matmul for
  batches of rows. oneDNN builds and keeps a kernel per row count, so row counts are rounded up
  to a few sizes (exact up to EXACT_ROWS, then multiples of it): the decode sizes are built at
  load, the few prefill sizes when first met.
- "plain", CUDA and anything else: F.linear.

A prepared weight replaces the plain one, so it costs no memory of its own (the MKL path keeps
two buffers of up to PLAIN_FLOATS floats each).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

EXACT_ROWS = 32
MKL_ROWS = 256  # float32 calls with this many rows are compute-bound, where MKL's sgemm is ~20% faster
PLAIN_FLOATS = 1 << 22  # the most of a weight laid out plainly at once for MKL (16 MB)
TILE_COLS = 32  # cpu_matmul.c's TILE_COLS
GATE_RUN = TILE_COLS // 2  # a gated tile: this many w1 rows, then as many w3 rows
MAX_HEAD_DIM = 256  # cpu_layer.c's MAX_HEAD_DIM: larger heads attend through PyTorch
SOURCES = [Path(__file__).with_name(name) for name in ("cpu_matmul.c", "cpu_layer.c", "cpu_decode.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_simd.h", "cpu_kernels.h")]
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp", "-shared", "-fPIC"]
KINDS = ("tiles", "onednn", "plain")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            return set(next((line for line in info if line.startswith("flags")), "").split())
    except OSError:
        return set()


@dataclass(frozen=True)
class Tiled:
    """A weight [out, in] (`shape`) in cpu_matmul.c's tile layout (`data`).

    gated: the rows are a SwiGLU's w1 and w3 interleaved in runs of GATE_RUN, and `linear`
    returns silu(x w1^T) * (x w3^T), out / 2 columns.
    """

    data: torch.Tensor
    shape: torch.Size
    gated: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


class DecodeLayer(ctypes.Structure):
    """cpu_decode.c's struct DecodeLayer: a layer's shapes (this rank's share) and its tensors' addresses."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("dim", "n_heads", "n_kv_heads", "head_dim", "ffn", "n_slots", "max_seq_len")),
        ("eps", ctypes.c_float),
        ("bf16", ctypes.c_int32),
        *((name, ctypes.c_void_p) for name in ("attention_norm", "ffn_norm", "wqkv", "wo", "w13", "w2", "cache_k", "cache_v")),
    ]


class DecodeRows(ctypes.Structure):
    """cpu_decode.c's struct DecodeRows: a decode step's rows (rotation as cos, sin pairs)."""

    _fields_ = [("rows", ctypes.c_int64), *((name, ctypes.c_void_p) for name in ("rotation", "slots", "positions"))]


def _cache_dirs() -> list[Path]:
    """Where the built library is kept: the user's cache, else a per-user temp folder (e.g. no HOME)."""
    folders = [Path(tempfile.gettempdir()) / f"tp_llama-{os.getuid()}"]
    try:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:  # no HOME and no passwd entry, as in some service sandboxes
        return folders
    return [cache / "tp_llama", *folders]


def _build(compiler: str) -> Path:
    """The compiled library, from the cache when this source and these flags were built before.

    Ranks may build at the same time: each writes its own file and renames it into place.
    """
    code = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    digest = hashlib.sha256(code + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    errors = []
    for folder in _cache_dirs():
        library = folder / f"cpu_kernels-{digest}.so"
        if library.is_file():
            return library
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            errors.append(f"{folder}: {exc}")
            continue
        if not os.access(folder, os.W_OK):
            errors.append(f"{folder}: not writable")
            continue
        partial = folder / f"cpu_kernels-{digest}.{os.getpid()}.tmp"
        try:
            subprocess.run([compiler, *FLAGS, "-o", str(partial), *map(str, SOURCES)],
                           check=True, capture_output=True, text=True, timeout=120)
        except subprocess.CalledProcessError as exc:
            partial.unlink(missing_ok=True)
            raise OSError(f"{compiler} failed on tp_llama's C kernels: {exc.stderr.strip()[-2000:]}") from exc
        os.replace(partial, library)
        return library
    raise OSError("no writable cache folder: " + "; ".join(errors))


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded C kernels, "") or (None, why not)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"no AVX-512 on {platform.machine()}"
    missing = {"avx512f", "avx512bw", "avx512vl", "fma"} - cpu_flags()
    if missing:
        return None, f"the CPU lacks {', '.join(sorted(missing))}"
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None, "no C compiler (gcc) to build tp_llama's C kernels"
    try:
        # torch is loaded, so the library's OpenMP resolves to the runtime torch already runs.
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not build tp_llama's C kernels: {exc}"
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    library.tiled_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, flag, flag]
    library.tiled_linear.restype = ctypes.c_int
    library.pack_tiles.argtypes = [ptr, i64, i64, ptr]
    library.pack_tiles.restype = None
    library.pack_tiles_in_place.argtypes = [ptr, i64, i64]
    library.pack_tiles_in_place.restype = ctypes.c_int
    library.untile_weight.argtypes = [ptr, i64, i64, i64, ptr]
    library.untile_weight.restype = None
    library.place_product.argtypes = [ptr, i64, i64, i64, i64, ptr, flag]
    library.place_product.restype = None
    library.rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, flag]
    library.rms_norm.restype = None
    library.decode_attention.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, ptr, flag]
    library.decode_attention.restype = ctypes.c_int
    layer, rows = ctypes.POINTER(DecodeLayer), ctypes.POINTER(DecodeRows)
    library.decode_scratch_bytes.argtypes = [layer, i64]
    library.decode_scratch_bytes.restype = i64
    library.attention_block.argtypes = [layer, rows, ptr, ptr, ptr, ptr]
    library.attention_block.restype = ctypes.c_int
    library.ffn_block.argtypes = [layer, i64, ptr, ptr, ptr, ptr]
    library.ffn_block.restype = None
    library.decode_stack.argtypes = [layer, i64, rows, ptr, ptr, ptr]
    library.decode_stack.restype = ctypes.c_int
    return library, ""


def matmul_kind(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(kind, why): which matmul this process's weights are prepared for, and why not a faster one."""
    forced = os.environ.get("TP_LLAMA_MATMUL")
    if forced is not None and forced not in KINDS:
        raise ValueError(f"TP_LLAMA_MATMUL={forced!r}: choose one of {', '.join(KINDS)}")
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or forced == "plain":
        return "plain", ""
    why = "TP_LLAMA_MATMUL=onednn" if forced == "onednn" else ""
    if forced != "onednn":
        library, why = _library()
        if library is not None:
            return "tiles", ""
    if torch.backends.mkldnn.is_available():
        return "onednn", why
    return "plain", why


def _tileable(weight: torch.Tensor) -> bool:
    """The tiles hold bfloat16 in pairs along k, so a bfloat16 weight needs an even width."""
    return not (weight.dtype == torch.bfloat16 and weight.shape[1] % 2)


def prepare(weight: torch.Tensor, kind: str, own: bool = False) -> torch.Tensor | Tiled:
    """weight [out, in] in the form `linear` runs fastest for `kind` (see matmul_kind).

    own: nothing else holds `weight` (a fused copy), so the tiles may take over its memory.
    """
    weight = weight.detach()
    if kind == "tiles" and _tileable(weight):
        out, cols = weight.shape
        units = weight.contiguous().view(torch.int32)  # a float32, or a pair of bfloat16 along k
        shape = (-(-out // TILE_COLS), units.shape[1], TILE_COLS)
        library = _library()[0]
        if own and out % TILE_COLS == 0:
            if library.pack_tiles_in_place(units.data_ptr(), out, units.shape[1]):
                raise MemoryError(f"no memory to pack a {tuple(weight.shape)} weight")
            return Tiled(units.view(shape).view(weight.dtype), weight.shape)
        data = torch.empty(shape, dtype=torch.int32)
        library.pack_tiles(units.data_ptr(), out, units.shape[1], data.data_ptr())
        return Tiled(data.view(weight.dtype), weight.shape)
    if kind in ("tiles", "onednn"):
        return torch.ops.mkldnn._reorder_linear_weight(weight, EXACT_ROWS)
    return weight


def prepare_swiglu(w1: torch.Tensor, w3: torch.Tensor, kind: str) -> Tiled | None:
    """w1 and w3 [ffn, in] as one gated weight (see Tiled), or None where `kind` cannot run one."""
    ffn, cols = w1.shape
    if kind != "tiles" or ffn % GATE_RUN or not _tileable(w1):
        return None
    runs = [w.detach().reshape(ffn // GATE_RUN, GATE_RUN, cols) for w in (w1, w3)]
    return dataclasses.replace(prepare(torch.stack(runs, dim=1).reshape(2 * ffn, cols), kind, own=True), gated=True)


def padded_rows(rows: int) -> int:
    return rows if rows <= EXACT_ROWS else -(-rows // EXACT_ROWS) * EXACT_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor | Tiled) -> torch.Tensor:
    """x [T, in] @ weight.T, whichever form the weight is in."""
    if isinstance(weight, Tiled):
        return _tiled_linear(x, weight)
    if not weight.is_mkldnn:
        return F.linear(x, weight)
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return out if padded == rows else out[:rows]


def _tiled_linear(x: torch.Tensor, weight: Tiled) -> torch.Tensor:
    if x.dtype != weight.dtype or x.device.type != "cpu":
        raise TypeError(f"a {weight.dtype} CPU weight got {x.dtype} input on {x.device}")
    out_features, in_features = weight.shape
    x = x.contiguous()
    rows = x.numel() // in_features
    y = torch.empty((*x.shape[:-1], out_features // 2 if weight.gated else out_features), dtype=x.dtype)
    library, _ = _library()
    if x.dtype == torch.float32 and rows >= MKL_ROWS:
        _mkl_linear(library, x.view(rows, in_features), weight, y)
        return y
    if rows and library.tiled_linear(x.data_ptr(), rows, in_features, weight.data.data_ptr(), out_features,
                                     y.data_ptr(), weight.gated, x.dtype == torch.bfloat16):
        raise MemoryError(f"no memory to widen {rows} x {in_features} bfloat16 inputs")
    return y


def _mkl_linear(library: ctypes.CDLL, x: torch.Tensor, weight: Tiled, y: torch.Tensor) -> None:
    """Many float32 rows: MKL's GEMM on the weight laid out plainly again, a slice of tiles at a time.

    MKL on the [in, TILE_COLS] tiles themselves (a batch of narrow GEMMs) runs 10-35% slower.
    """
    tiles, in_features, _ = weight.data.shape
    per = max(1, PLAIN_FLOATS // (max(in_features, x.shape[0]) * TILE_COLS))  # tiles per slice: both buffers bounded
    plain = _scratch("plain", in_features * min(per, tiles) * TILE_COLS)
    product = _scratch("product", x.shape[0] * min(per, tiles) * TILE_COLS)
    for t0 in range(0, tiles, per):
        n = min(per, tiles - t0)
        block = plain[: in_features * n * TILE_COLS].view(in_features, n * TILE_COLS)
        library.untile_weight(weight.data.data_ptr(), in_features, t0, n, block.data_ptr())
        out = product[: x.shape[0] * n * TILE_COLS].view(x.shape[0], n * TILE_COLS)
        torch.mm(x, block, out=out)
        library.place_product(out.data_ptr(), x.shape[0], t0, n, weight.shape[0], y.data_ptr(), weight.gated)


_scratches: dict[str, torch.Tensor] = {}


def _scratch(name: str, floats: int) -> torch.Tensor:
    """A float32 buffer kept between calls: fresh pages for every prefill matmul cost more than the copy."""
    buffer = _scratches.get(name)
    if buffer is None or buffer.numel() < floats:
        buffer = _scratches[name] = torch.empty(floats)
    return buffer


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Meta's RMSNorm over the last dim, one C call (cpu_layer.c; CPU float32 or bfloat16)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    dim = x.shape[-1]
    _library()[0].rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, eps,
                           x.dtype == torch.bfloat16)
    return y


def decode_attention(qkv: torch.Tensor, rotation: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     cache_k: torch.Tensor, cache_v: torch.Tensor, out: torch.Tensor) -> None:
    """Attention of one new token per row, in one C call: RoPE, the cache write, softmax(qK)V.

    qkv [rows, (heads + 2 kv_heads) * head_dim], rotation [rows, ..., head_dim / 2] complex,
    slots and positions [rows] int64 (distinct slots); writes out [rows, heads * head_dim] and
    each row's new key and value into cache_k / cache_v [slots, kv_heads, max_seq_len, head_dim].
    """
    rows = qkv.shape[0]
    if not rows:
        return
    n_slots, n_kv_heads, max_seq_len, head_dim = cache_k.shape
    tensors = (qkv, rotation, slots, positions, cache_k, cache_v, out)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("decode_attention needs contiguous tensors")
    status = _library()[0].decode_attention(
        qkv.data_ptr(), torch.view_as_real(rotation).data_ptr(), slots.data_ptr(), positions.data_ptr(), rows,
        out.shape[1] // head_dim, n_kv_heads, head_dim, cache_k.data_ptr(), cache_v.data_ptr(), n_slots,
        max_seq_len, out.data_ptr(), qkv.dtype == torch.bfloat16)
    _raise_for_attention(status, cache_k)


def _raise_for_attention(status: int, cache_k: torch.Tensor) -> None:
    if status == -2:
        raise IndexError(f"a decode row's slot or position lies outside the KV cache {tuple(cache_k.shape)}")
    if status == -3:
        raise ValueError(f"decode attention takes heads of up to {MAX_HEAD_DIM}, not {cache_k.shape[-1]}")
    if status:
        raise MemoryError("no memory for attention scores")


def decode_layer(norms: tuple[torch.Tensor, torch.Tensor], weights: tuple[Tiled, Tiled, Tiled, Tiled],
                 cache_k: torch.Tensor, cache_v: torch.Tensor, eps: float) -> DecodeLayer | None:
    """A layer as decode_stack, attention_block and ffn_block run it, or None where they cannot.

    norms: (attention_norm, ffn_norm) weights; weights: wqkv, wo, the gated w1/w3, w2 (this rank's
    shards) in tiles; the cache [slots, kv_heads, max_seq_len, head_dim]. The layer's tensors must
    outlive the returned struct, which holds only their addresses.
    """
    wqkv, wo, w13, w2 = weights
    if not all(isinstance(w, Tiled) for w in weights) or wqkv.gated or wo.gated or w2.gated or not w13.gated:
        return None
    n_slots, n_kv_heads, max_seq_len, head_dim = cache_k.shape
    n_heads = wo.shape[1] // head_dim
    if head_dim > MAX_HEAD_DIM or n_heads % n_kv_heads or wqkv.shape[0] != (n_heads + 2 * n_kv_heads) * head_dim:
        return None
    tensors = (*norms, *(w.data for w in weights), cache_k, cache_v)
    if not all(t.is_contiguous() and t.dtype == cache_k.dtype for t in tensors):
        return None
    return DecodeLayer(wo.shape[0], n_heads, n_kv_heads, head_dim, w2.shape[1], n_slots, max_seq_len, eps,
                       cache_k.dtype == torch.bfloat16, *(t.data_ptr() for t in tensors))


def decode_rows(rotation: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> DecodeRows:
    """A decode step's rows: rotation [rows, ..., head_dim / 2] complex, slots and positions [rows] int64.

    The tensors must outlive the returned struct.
    """
    tensors = (rotation, slots, positions)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("decode rows need contiguous tensors")
    return DecodeRows(slots.shape[0], torch.view_as_real(rotation).data_ptr(), slots.data_ptr(), positions.data_ptr())


def decode_scratch(layer: DecodeLayer, rows: int) -> torch.Tensor:
    """The scratch attention_block, ffn_block and decode_stack need for `rows` rows of these layers."""
    return torch.empty(_library()[0].decode_scratch_bytes(ctypes.byref(layer), rows), dtype=torch.uint8)


def attention_block(layer: DecodeLayer, rows: DecodeRows, h: torch.Tensor, delta: torch.Tensor | None,
                    out: torch.Tensor, scratch: torch.Tensor, cache_k: torch.Tensor) -> None:
    """h += delta, then out = wo(attention(attention_norm(h))), one C call (cpu_decode.c). h, delta, out [rows, dim]."""
    status = _library()[0].attention_block(ctypes.byref(layer), ctypes.byref(rows), h.data_ptr(),
                                           None if delta is None else delta.data_ptr(), out.data_ptr(),
                                           scratch.data_ptr())
    _raise_for_attention(status, cache_k)


def ffn_block(layer: DecodeLayer, h: torch.Tensor, delta: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """h += delta, then out = w2(SwiGLU(ffn_norm(h))), one C call (cpu_decode.c)."""
    _library()[0].ffn_block(ctypes.byref(layer), h.shape[0], h.data_ptr(), delta.data_ptr(), out.data_ptr(),
                            scratch.data_ptr())


def decode_stack(layers: ctypes.Array, rows: DecodeRows, h: torch.Tensor, scratch: torch.Tensor,
                 cache_k: torch.Tensor) -> None:
    """Every layer (a DecodeLayer array; no tensor parallelism) on h [rows, dim], in place, one C call."""
    delta = torch.empty_like(h)
    status = _library()[0].decode_stack(layers, len(layers), ctypes.byref(rows), h.data_ptr(), delta.data_ptr(),
                                        scratch.data_ptr())
    _raise_for_attention(status, cache_k)


@torch.inference_mode()
def warm_up(weights: list[torch.Tensor | Tiled], max_rows: int, dtype: torch.dtype) -> None:
    """Build oneDNN's kernel for every decode batch size (up to max_rows), now rather than mid-serving."""
    sizes = sorted({padded_rows(rows) for rows in range(1, min(max_rows, EXACT_ROWS) + 1)})
    shapes = {tuple(w.shape): w for w in weights if isinstance(w, torch.Tensor) and w.is_mkldnn}
    for weight in shapes.values():  # kernels depend on shapes, not values
        for rows in sizes:
            linear(torch.zeros(rows, weight.shape[1], dtype=dtype), weight)
