"""The C kernels on tensors: tiled weights and their matmul, RMSNorm, decode attention, a decode
step's layers and their rows' LoRA adapters. Each function takes and returns tensors (or fills
`out`), so it can be registered as a custom op where a tracer needs one.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

import torch

from tp_llama.kernels.cpu.ffi import Library, amx_ready, library
from tp_llama.kernels.cpu.qtiles import QuantTiled
from tp_llama.pages import huge_empty


@dataclass(frozen=True)
class Tiled:
    """A weight [out, in] (`shape`) in matmul.c's tile layout (`data`).

    gated: the rows are a SwiGLU's w1 and w3 interleaved in runs of GATE_RUN, and `tiled_linear`
    returns silu(x w1^T) * (x w3^T), out / 2 columns. amx: bfloat16 calls run on AMX at every row
    count (a row's bits then do not depend on its batch), the tiles in AMX's layout where the width
    allows (a multiple of 32; pack_tiles).
    """

    data: torch.Tensor
    shape: torch.Size
    gated: bool = False
    amx: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def tileable(weight: torch.Tensor) -> bool:
    """The tiles hold bfloat16 in pairs along k, so a bfloat16 weight needs an even width."""
    return weight.dtype in (torch.float32, torch.bfloat16) and not (weight.dtype == torch.bfloat16 and weight.shape[1] % 2)


def prepare_tiles(weight: torch.Tensor, amx: bool = False) -> Tiled:
    """weight [out, in] in tiles, on 2 MiB pages where Linux gives them (tp_llama.pages); amx: see Tiled."""
    lib, out = library(), weight.shape[0]
    cols = lib.constants["TILE_COLS"]
    units = weight.detach().contiguous().view(torch.int32)  # a float32, or a pair of bfloat16 along k
    shape = (-(-out // cols), units.shape[1], cols)
    data = huge_empty(shape, torch.int32)
    amx = amx and weight.dtype == torch.bfloat16 and amx_ready()  # else the FMA tiles would read AMX's layout
    lib.pack_tiles(units.data_ptr(), out, units.shape[1], data.data_ptr(), amx)
    return Tiled(data.view(weight.dtype), weight.shape, amx=amx)


def prepare_swiglu_tiles(w1: torch.Tensor, w3: torch.Tensor, amx: bool = False) -> Tiled | None:
    """w1 and w3 [ffn, in] as one gated weight (see Tiled), or None where the widths do not allow it."""
    run = library().constants["GATE_RUN"]
    ffn, cols = w1.shape
    if ffn % run or not tileable(w1):
        return None
    runs = [w.detach().reshape(ffn // run, run, cols) for w in (w1, w3)]
    return dataclasses.replace(prepare_tiles(torch.stack(runs, dim=1).reshape(2 * ffn, cols), amx), gated=True)


def tiled_linear(x: torch.Tensor, weight: Tiled, lib: Library | None = None) -> torch.Tensor:
    """x [..., in] @ weight.T (or the gated product), every row by the tiles at any row count, so a
    row's bits never depend on how many share the call.

    lib: the kernels whose tiles multiply, the loaded ones by default (bench/kernels/matmul.py --before passes
    an older checkout's build).
    """
    if x.dtype != weight.dtype or x.device.type != "cpu":
        raise TypeError(f"a {weight.dtype} CPU weight got {x.dtype} input on {x.device}")
    out_features, in_features = weight.shape
    x = x.contiguous()
    rows = x.numel() // in_features
    y = torch.empty((*x.shape[:-1], out_features // 2 if weight.gated else out_features), dtype=x.dtype)
    lib = lib or library()
    if rows and lib.tiled_linear(x.data_ptr(), rows, in_features, weight.data.data_ptr(), out_features,
                                 y.data_ptr(), weight.gated, x.dtype == torch.bfloat16, weight.amx):
        raise MemoryError(f"no memory to widen {rows} x {in_features} bfloat16 inputs")
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Meta's RMSNorm over the last dim, one C call (CPU float32 or bfloat16)."""
    x = x.contiguous()
    y, dim = torch.empty_like(x), x.shape[-1]
    library().rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, eps,
                       x.dtype == torch.bfloat16)
    return y


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [rows, 2F] (each row's gate columns, then its up columns), float32 or bfloat16."""
    x = x.contiguous()
    rows, width = x.shape
    y = x.new_empty((rows, width // 2))
    library().swiglu(x.data_ptr(), rows, width // 2, y.data_ptr(), x.dtype == torch.bfloat16)
    return y


def residual_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place, unless None), then RMSNorm(h), one C call. h, delta [rows, dim] contiguous."""
    y = torch.empty_like(h)
    library().residual_norm(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                            y.data_ptr(), h.shape[0], h.shape[1], eps, h.dtype == torch.bfloat16)
    return y


def _raise_for(status: int, cache_k: torch.Tensor) -> None:
    """The exception for a kernel's status code (none for TPL_OK)."""
    codes = library().constants
    if status == codes["TPL_OK"]:
        return
    if status == codes["TPL_OFF_CACHE"]:
        raise IndexError(f"a row's position or block lies outside its block table or the KV cache "
                         f"{tuple(cache_k.shape)}")
    if status == codes["TPL_HEAD_DIM"]:
        raise ValueError(f"decode attention takes heads of up to {codes['MAX_HEAD_DIM']}, not {cache_k.shape[-1]}")
    raise MemoryError("no memory for attention scores")


def decode_attention(qkv: torch.Tensor, rows: ctypes.Structure, cache_k: torch.Tensor, cache_v: torch.Tensor,
                     block_size: int, out: torch.Tensor, write_first: bool = False, window: int | None = None) -> None:
    """Attention of one new token per row (`decode_rows`), in one C call: RoPE, the cache write, softmax(qK)V.

    qkv [rows, (heads + 2 kv_heads) * head_dim]; writes out [rows, heads * head_dim] and each
    row's new key and value into cache_k / cache_v [kv_heads, blocks * block_size, head_dim].
    write_first: rows that see each other's keys (a prompt chunk's tokens, each a row at its own
    position) have every key written before any row attends; each row gets a decode step's bits.
    window (a multiple of block_size): a row at position p sees the keys from p // window * window on (Llama 4).
    """
    if not rows.rows:
        return
    n_kv_heads, pool, head_dim = cache_k.shape
    if not all(t.is_contiguous() for t in (qkv, cache_k, cache_v, out)):
        raise ValueError("decode_attention needs contiguous tensors")
    if window is not None and (window <= 0 or window % block_size):
        raise ValueError(f"attention window {window}: not a multiple of the cache's {block_size}-position blocks")
    status = library().decode_attention(
        qkv.data_ptr(), ctypes.byref(rows), out.shape[1] // head_dim, n_kv_heads, head_dim, cache_k.data_ptr(),
        cache_v.data_ptr(), pool // block_size, block_size, out.data_ptr(), qkv.dtype == torch.bfloat16, write_first,
        window or 0)
    _raise_for(status, cache_k)


def rope_prompt_rows(qkv: torch.Tensor, rotation: torch.Tensor, locations: torch.Tensor, n_heads: int,
                     cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
    """Prompt rows' RoPE and cache write in one C call: q and k heads rotated in place in qkv
    [rows, (heads + 2 kv_heads) * head_dim], each row's key and value written to cache index
    locations[row] of cache_k / cache_v [kv_heads, cache_len, head_dim]. rotation [rows, ..., head_dim / 2, 2]."""
    n_kv_heads, cache_len, head_dim = cache_k.shape
    if not all(t.is_contiguous() for t in (qkv, rotation, locations, cache_k, cache_v)) or locations.dtype != torch.long:
        raise ValueError("rope_prompt_rows needs contiguous tensors and int64 locations")
    rows = qkv.shape[0]
    if locations.shape != (rows,) or rotation.numel() != rows * head_dim:
        raise ValueError(f"{rows} rows need {rows} locations and {rows} x {head_dim} rotation values")
    if qkv.dtype != cache_k.dtype or qkv.shape[1] != (n_heads + 2 * n_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} {qkv.dtype} does not fit a cache {tuple(cache_k.shape)} {cache_k.dtype}")
    status = library().rope_prompt_rows(qkv.data_ptr(), rows, rotation.data_ptr(), locations.data_ptr(),
                                        n_heads, n_kv_heads, head_dim, cache_k.data_ptr(), cache_v.data_ptr(),
                                        cache_len, qkv.dtype == torch.bfloat16)
    if status:
        raise IndexError(f"a prompt row's cache index lies outside the KV cache {tuple(cache_k.shape)}")


def blocked_prompts(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prompt_attention runs prompt chunks of this dtype and head size (else they attend as
    decode rows, decode_attention's write_first)."""
    lib = library()
    return (dtype == torch.bfloat16 and head_dim % 64 == 0 and head_dim <= lib.constants["MAX_HEAD_DIM"]
            and not (lib.variant.endswith("-amx") and not amx_ready()))


def prompt_attention(qkv: torch.Tensor, n_heads: int, head_dim: int, cache_k: torch.Tensor, cache_v: torch.Tensor,
                     block_size: int, table: torch.Tensor, start: int, out: torch.Tensor) -> bool:
    """One sequence's prompt chunk in C (causal): out [rows, heads * head_dim] for its rows at positions
    start .., their rotated q heads at the start of each row of qkv, against the sequence's keys and values
    0 .. start + rows - 1 in cache_k / cache_v [kv_heads, blocks * block_size, head_dim] through its block
    table (int64). False where the kernel cannot (float32, a head_dim it does not take, an AMX build
    without the tile state, no memory for the keys' layout); nothing is written then."""
    rows = qkv.shape[0]
    lib = library()
    if not (qkv.dtype == out.dtype == cache_k.dtype == torch.bfloat16 and qkv.stride(1) == out.stride(1) == 1
            and table.dtype == torch.long and table.is_contiguous()):
        return False
    if lib.variant.endswith("-amx") and not amx_ready():
        return False
    if not (cache_k.is_contiguous() and cache_v.is_contiguous()):
        raise ValueError("prompt_attention needs contiguous caches")
    if rows and (start + rows - 1) // block_size >= table.numel():  # the C call reads that many entries
        raise IndexError(f"positions up to {start + rows - 1} lie outside a block table of {table.numel()} blocks "
                         f"of {block_size}")
    n_kv_heads, pool, _ = cache_k.shape
    status = lib.prompt_attention(qkv.data_ptr(), rows, qkv.stride(0), n_heads, n_kv_heads, head_dim,
                                  cache_k.data_ptr(), cache_v.data_ptr(), pool // block_size, block_size,
                                  table.data_ptr(), start, out.data_ptr(), out.stride(0))
    if status in (lib.constants["TPL_HEAD_DIM"], lib.constants["TPL_NO_MEMORY"]):
        return False  # no memory for its layout of a long sequence's keys: flash attention needs none
    _raise_for(status, cache_k)
    return True


def _meta_int4(weight: object) -> bool:
    """Whether `weight` is one of Meta's int4 weights in tiles whose input rows are whole (not a
    row-parallel shard's, whose range needs the other ranks' parts between C calls)."""
    across = getattr(weight, "across", None)
    return isinstance(getattr(weight, "c", None), library().structs["MetaInt4"]) and (across is None or across.size == 1)


@dataclass(frozen=True)
class LoraTensors:
    """One projection's LoRA adapters in fixed slots as lora.c reads them: a [slots, rank, in], bt [slots, rank,
    out] (B^T, the scale folded in) and its copy in vectors of 16 columns, `tiles` [slots, vectors, lines, 16]
    (lora_tiles, from the ranks `first` [vectors] on), float32 or bfloat16 alike, slot 0 the base. `c`, their
    struct LoraWeights, holds only their addresses: whoever holds `c` holds this too."""

    a: torch.Tensor
    bt: torch.Tensor
    tiles: torch.Tensor
    first: torch.Tensor
    c: ctypes.Structure


def lora_tiles(bt: torch.Tensor, first: torch.Tensor, lines: int) -> torch.Tensor:
    """bt [..., rank, out] in vectors of 16 columns (zeros past out): [..., vectors, lines, 16], vector v's lines
    the ranks first[v] .. first[v] + lines - 1 of its columns."""
    vectors = len(first)
    padded = torch.nn.functional.pad(bt, (0, vectors * 16 - bt.shape[-1])).unflatten(-1, (vectors, 16))
    ranks = first.long()[:, None] + torch.arange(lines)
    return padded[..., ranks, torch.arange(vectors)[:, None], :]


def lora_weights(a: torch.Tensor, bt: torch.Tensor, first: torch.Tensor | None = None,
                 lines: int | None = None) -> LoraTensors:
    """a [slots, rank, in] and bt [slots, rank, out] CPU tensors (both float32 or both bfloat16) as one
    projection's adapters. first [ceil(out / 16)] and lines: each 16 columns' ranks first .. first + lines - 1,
    where B^T is zero at the others (lora/slots.py's block_lines); None: every rank."""
    if a.dtype != bt.dtype or a.dtype not in (torch.float32, torch.bfloat16) or a.dim() != 3 \
            or a.shape[:2] != bt.shape[:2] or a.device.type != "cpu" or bt.device.type != "cpu":
        raise ValueError(f"LoRA weights are float32 or bfloat16 CPU a [slots, rank, in] and bt [slots, rank, out] "
                         f"of one type, not {a.dtype} {tuple(a.shape)} and {bt.dtype} {tuple(bt.shape)}")
    rank, vectors = a.shape[1], -(-bt.shape[2] // 16)
    if first is None:
        first, lines = torch.zeros(vectors, dtype=torch.int32), rank
    first = first.to(torch.int32).contiguous()
    if first.shape != (vectors,) or lines is None or not 0 < lines <= rank \
            or not bool(((0 <= first) & (first <= rank - lines)).all()):
        raise ValueError(f"first [{vectors}] and lines are runs of ranks within 0 .. {rank}, not "
                         f"{tuple(first.shape)} and {lines}")
    a, tiles = a.contiguous(), lora_tiles(bt, first, lines).contiguous()
    c = library().structs["LoraWeights"](a.data_ptr(), tiles.data_ptr(), first.data_ptr(), a.shape[0], rank, lines,
                                         a.dtype == torch.bfloat16)
    return LoraTensors(a, bt, tiles, first, c)


def lora_retile(lora: LoraTensors, slot: int) -> None:
    """The C kernels' copy of one slot's B^T made again from `lora.bt` (after an adapter is written there)."""
    lora.tiles[slot].copy_(lora_tiles(lora.bt[slot], lora.first, lora.tiles.shape[2]))


def _check_adapters(adapters: torch.Tensor, rows: int) -> None:
    if adapters.dtype != torch.int32 or adapters.shape != (rows,) or not adapters.is_contiguous():
        raise ValueError(f"{rows} rows need contiguous int32 adapter slots [{rows}], not {adapters.dtype} "
                         f"{tuple(adapters.shape)}")


def lora_add(x: torch.Tensor, adapters: torch.Tensor, lora: LoraTensors, y: torch.Tensor) -> None:
    """y [rows, out] += (x A_s^T) B_s^T, in place, for each row on slot s = adapters[row] > 0 (int32 [rows]);
    x [rows, in] and y float32 or bfloat16 alike, contiguous. One C call (lora.c)."""
    rows, width = x.shape
    slots, _, out = lora.bt.shape
    _check_adapters(adapters, rows)
    if y.shape != (rows, out) or lora.a.shape[2] != width or x.dtype != y.dtype \
            or x.dtype not in (torch.float32, torch.bfloat16) or not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and y {tuple(y.shape)} {y.dtype} do not fit adapters "
                         f"of {width} -> {out}")
    if rows and not 0 <= int(adapters.min()) <= int(adapters.max()) < slots:
        raise ValueError(f"adapter slots lie in 0 .. {slots - 1}")
    if library().lora_add(ctypes.byref(lora.c), x.data_ptr(), rows, width, adapters.data_ptr(), y.data_ptr(), out,
                          x.dtype == torch.bfloat16):
        raise MemoryError(f"no memory for {rows} rows' LoRA scratch")


Adapters = tuple[LoraTensors | None, LoraTensors | None, LoraTensors | None, LoraTensors | None]  # wqkv, wo, w13, w2


def _lora_pointers(lora: Adapters | None, weights: tuple, meta: bool) -> list:
    """Each projection's struct LoraWeights pointer (None: no adapters), checked against its weight's shape."""
    if lora is None or not any(lora):
        return [None] * 4
    if meta:
        raise ValueError("Meta's int4 layers take no LoRA adapters in C")
    for name, adapters, weight in zip(("wqkv", "wo", "w13", "w2"), lora, weights):
        if adapters is not None and (adapters.a.shape[2], adapters.bt.shape[2]) != (weight.shape[1], weight.shape[0]):
            raise ValueError(f"{name}'s adapters map {adapters.a.shape[2]} -> {adapters.bt.shape[2]}, its weight "
                             f"{weight.shape[1]} -> {weight.shape[0]}")
    return [None if adapters is None else ctypes.pointer(adapters.c) for adapters in lora]


def decode_layer(norms: tuple[torch.Tensor, torch.Tensor], weights: tuple[Tiled | QuantTiled, ...],
                 cache_k: torch.Tensor, cache_v: torch.Tensor, block_size: int, eps: float,
                 lora: Adapters | None = None) -> ctypes.Structure | None:
    """A layer as decode_stack, attention_block and ffn_block run it (struct DecodeLayer), or None where they cannot.

    norms: (attention_norm, ffn_norm) weights; weights: wqkv, wo, the gated w1/w3, w2 (this rank's
    shards) in tiles, all float or all quantized alike, or all four Meta's int4 weights in tiles (each
    with its `shape` and `c`, its struct MetaInt4: kernels.meta_int4.pack_tiles; without tensor
    parallelism), their w1/w3 side by side;
    the cache [kv_heads, blocks * block_size, head_dim]. The layer's tensors must outlive the returned
    struct, which holds only their addresses. lora: the adapters of wqkv, wo, w1/w3 and w2 (None: none),
    w1/w3's bt columns in the gated tiles' order (GATE_RUN gate columns, then as many up columns, a tile);
    not for Meta's int4 weights. The returned struct keeps them (its `lora`).
    """
    lib = library()
    wqkv, wo, w13, w2 = weights
    meta = all(_meta_int4(w) for w in weights)
    bits = {lib.constants["META_INT4"]} if meta else {w.bits if isinstance(w, QuantTiled) else 16 for w in weights}
    if not meta and (not all(isinstance(w, (Tiled, QuantTiled)) for w in weights) or len(bits) > 1
                     or wqkv.gated or wo.gated or w2.gated or not w13.gated):
        return None
    n_kv_heads, pool, head_dim = cache_k.shape
    n_heads = wo.shape[1] // head_dim
    if (head_dim > lib.constants["MAX_HEAD_DIM"] or n_heads % n_kv_heads or block_size % lib.constants["KEY_RUN"]
            or wqkv.shape[0] != (n_heads + 2 * n_kv_heads) * head_dim):
        return None
    float_weights = bits == {16}
    tensors = (*norms, cache_k, cache_v) if meta else (*norms, *(w.data for w in weights), cache_k, cache_v)
    if not all(t.is_contiguous() and (t.dtype == cache_k.dtype or not float_weights) for t in tensors):
        return None
    if not all(t.dtype == cache_k.dtype for t in (*norms, cache_k, cache_v)):
        return None
    amx = float_weights and all(w.amx for w in weights)
    pointers = [ctypes.addressof(w.c) for w in weights] if meta else [w.data.data_ptr() for w in weights]
    layer = lib.structs["DecodeLayer"](wo.shape[0], n_heads, n_kv_heads, head_dim, w2.shape[1], pool // block_size,
                                       block_size, eps, cache_k.dtype == torch.bfloat16, amx, bits.pop(),
                                       norms[0].data_ptr(), norms[1].data_ptr(), *pointers, cache_k.data_ptr(),
                                       cache_v.data_ptr(), *_lora_pointers(lora, weights, meta))
    layer.lora = lora
    return layer


def decode_layers(layers: list[ctypes.Structure]) -> ctypes.Array:
    """The layers as one C array, for decode_stack (holding the layers, and so their adapters)."""
    array = (library().structs["DecodeLayer"] * len(layers))(*layers)
    array.layers = layers
    return array


def decode_rows(rotation: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                adapters: torch.Tensor | None = None) -> ctypes.Structure:
    """A decode step's rows (struct DecodeRows): rotation [rows, ..., head_dim / 2, 2] (cos, sin), block
    tables [rows, width] and positions [rows] int64, and each row's LoRA slot (int32 [rows]; None: every
    row the base). The tensors must outlive the returned struct."""
    if not all(t.is_contiguous() for t in (rotation, tables, positions)) or tables.dtype != torch.long:
        raise ValueError("decode rows need contiguous tensors and int64 block tables")
    if adapters is not None:
        _check_adapters(adapters, positions.shape[0])
    return library().structs["DecodeRows"](positions.shape[0], tables.shape[1], rotation.data_ptr(),
                                           tables.data_ptr(), positions.data_ptr(),
                                           None if adapters is None else adapters.data_ptr())


def decode_scratch(layers: ctypes.Array, rows: int) -> torch.Tensor:
    """The scratch attention_block, ffn_block and decode_stack need for `rows` rows of any of these layers (a
    layer's LoRA adapters widen its own)."""
    lib = library()
    return torch.empty(max(lib.decode_scratch_bytes(ctypes.byref(layer), rows) for layer in layers), dtype=torch.uint8)


def attention_block(layer: ctypes.Structure, rows: ctypes.Structure, h: torch.Tensor, delta: torch.Tensor | None,
                    out: torch.Tensor, scratch: torch.Tensor, cache_k: torch.Tensor, write_first: bool = False) -> None:
    """h += delta, then out = wo(attention(attention_norm(h))), one C call. h, delta, out [rows, dim].
    write_first: rows that see each other's keys (decode_attention's)."""
    status = library().attention_block(ctypes.byref(layer), ctypes.byref(rows), h.data_ptr(),
                                       None if delta is None else delta.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                                       write_first)
    _raise_for(status, cache_k)


def ffn_block(layer: ctypes.Structure, h: torch.Tensor, delta: torch.Tensor, out: torch.Tensor,
              scratch: torch.Tensor, adapters: torch.Tensor | None = None) -> None:
    """h += delta, then out = w2(SwiGLU(ffn_norm(h))), one C call; adapters: each row's LoRA slot (int32
    [rows]; None: every row the base)."""
    if adapters is not None:
        _check_adapters(adapters, h.shape[0])
    library().ffn_block(ctypes.byref(layer), h.shape[0], None if adapters is None else adapters.data_ptr(),
                        h.data_ptr(), delta.data_ptr(), out.data_ptr(), scratch.data_ptr())


def decode_stack(layers: ctypes.Array, rows: ctypes.Structure, h: torch.Tensor, scratch: torch.Tensor,
                 cache_k: torch.Tensor, write_first: bool = False) -> None:
    """Every layer (decode_layers' array; no tensor parallelism) on h [rows, dim], in place, one C call.
    write_first: rows that see each other's keys (decode_attention's)."""
    delta = torch.empty_like(h)
    status = library().decode_stack(layers, len(layers), ctypes.byref(rows), h.data_ptr(), delta.data_ptr(),
                                    scratch.data_ptr(), write_first)
    _raise_for(status, cache_k)
