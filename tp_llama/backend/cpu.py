"""The C kernels' modules (AVX-512 and AVX2 CPUs, tp_llama.kernels.cpu), swapped in after fusion.

- RMSNorm in one C call.
- SwiGLU in the w1/w3 matmul's tiles: a gated weight whose matmul ends in silu(gate) * up (a C call
  of its own after Meta's int4 weights).
- Decode rows' attention (RoPE, the cache write, softmax(qK)V) in one C call; prompt rows' RoPE and
  cache write in another, then each chunk's attention in a third (bfloat16; PyTorch's in float32).
- A decode-only step's layers in C: one call for them all without tensor parallelism, two per
  layer under it (the all-reduces between them). A step with prompt rows runs each layer's FFN
  half as the same C call, after one for the residual add and the attention norm.

Every output is computed from its own row in a fixed order, so a row gets the same bits alone
and batched, and the C layers give the op-by-op path's bits.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import torch
from torch import nn

from tp_llama.backend.fused import FusedAttention, FusedFeedForward, serving_linear
from tp_llama.kernels import Weight, linear, prepare_swiglu
from tp_llama.kernels.cpu import ops
from tp_llama.kernels.cpu.ffi import library
from tp_llama.model.batch import Batch
from tp_llama.model.kv_cache import KVCache, attend_chunk
from tp_llama.model.llama import FeedForward, Layers, RMSNorm, Transformer
from tp_llama.parallel.layout import ALL_REDUCE, NONE


class CRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class GatedFeedForward(nn.Module):
    lora_w13 = None  # LoRA adapters' w1/w3 delta, its columns in the tiles' order (lora/slots.py), where held

    def __init__(self, w13: Weight, w2: nn.Module):
        super().__init__()
        self.w13, self.w2 = w13, w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_w13 is None or not self.lora_w13.step.groups:
            return self.w2(linear(x, self.w13))
        # Adapters add before SwiGLU: the tiles' gate and up runs, then SwiGLU on them in w1, w3 order.
        tiled = self.lora_w13.add(linear(x, replace(self.w13, gated=False)), x)
        run = library().constants["GATE_RUN"]
        return self.w2(ops.swiglu(tiled.unflatten(1, (-1, 2, run)).transpose(1, 2).flatten(1)))


class CFeedForward(GatedFeedForward):
    """w1/w3 side by side in a matmul whose tiles cannot end in SwiGLU (Meta's int4 weights), then SwiGLU in C."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.swiglu(linear(x, self.w13)))


def feed_forward(ffn: FeedForward, kind: str, bits: int) -> nn.Module:
    """The gated tiles where the FFN's width allows them, else w1/w3 fused as on other devices."""
    w13 = prepare_swiglu(ffn.w1.weight, ffn.w3.weight, kind, bits)
    if w13 is None:
        return FusedFeedForward(ffn, kind, bits=bits)
    return GatedFeedForward(w13, serving_linear(ffn.w2, kind, bits=bits))


def decode_tokens(batch: Batch, dtype: torch.dtype, head_dim: int) -> int:
    """How many of the step's first tokens attend as decode rows: every one where prompt_attention.c does not
    run prompts, else the decode rows and those counted in n_verify (proposals, decoded tokens), whose bits
    must be those of decode steps."""
    return batch.n_decode + batch.n_verify if ops.blocked_prompts(dtype, head_dim) else len(batch.tokens)


class CAttention(FusedAttention):
    """Decode rows' attention in one C call. Prompt rows: in bfloat16 with heads of a multiple of 64,
    RoPE and the cache write in another, then each chunk's attention in C; otherwise every token of
    the step as a decode row of its own, so a prompt token gets a decoded token's bits."""

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, batch: Batch) -> torch.Tensor:
        qkv = self.qkv(x)
        done = decode_tokens(batch, qkv.dtype, self.head_dim)
        out = qkv.new_empty((qkv.shape[0], self.widths[0]))
        cache = self.cache
        if done:
            tables = batch.tables_of(done)  # alive for the call
            rows = ops.decode_rows(rotation[:done], tables, batch.positions[:done])
            ops.decode_attention(qkv[:done], rows, cache.k, cache.v, cache.block_size, out[:done],
                                 write_first=done > batch.n_decode)  # rows that see each other's keys
        if done < qkv.shape[0]:
            self._attend_prompts(qkv[done:], rotation[done:], batch, done, out[done:])
        return self.wo(out)

    def _attend_prompts(self, qkv: torch.Tensor, rotation: torch.Tensor, batch: Batch, done: int,
                        out: torch.Tensor) -> None:
        """Prompt rows into out: RoPE and the cache write in C, then each chunk against its sequence's
        keys so far in C (faster than PyTorch's flash kernel at prompt lengths on every build,
        bench/kernels/attention.py), through PyTorch's flash attention where it has no memory for a
        long sequence's keys."""
        n_q, n_kv = self.widths
        cache = self.cache
        ops.rope_prompt_rows(qkv, rotation, batch.locations[done:], n_q // self.head_dim, cache.k, cache.v)
        q, k, v = (part.unflatten(-1, (-1, self.head_dim)) for part in qkv.split([n_q, n_kv, n_kv], dim=1))
        for first, row, start, length in batch.prefill:
            if first < done:
                continue  # a verifying row, attended as decode rows
            rows = slice(first - done, first - done + length)
            if not ops.prompt_attention(qkv[rows], n_q // self.head_dim, self.head_dim, cache.k, cache.v,
                                        cache.block_size, batch.tables[row], start, out[rows]):
                out[rows] = attend_chunk(cache, q[rows], k[rows], v[rows], batch, row, start).flatten(1)


class DecodeLayers(Layers):
    """The blocks, with a decode-only step's layers in C when every block can run there, and a step
    with prompt rows through the same C FFN halves (its attention from Python, each chunk on its own)."""

    def __init__(self, layers: Layers):
        super().__init__(layers)
        self._planned: tuple[list[KVCache], ctypes.Array | None] | None = None

    def forward(self, h: torch.Tensor, rotation: torch.Tensor, batch: Batch) -> torch.Tensor:
        structs = self._structs()
        if structs is None:
            return super().forward(h, rotation, batch)
        scratch = ops.decode_scratch(structs, len(h))
        h = h.contiguous()
        if 0 < batch.n_decode + batch.n_verify == len(h):  # decode rows, and rows verifying proposals
            return self._decode(structs, h, rotation, batch, scratch)
        delta = torch.empty_like(h)
        for i, (layer, c_layer) in enumerate(zip(self, structs)):
            norm = layer.attention_norm
            x = ops.residual_norm(h, delta if i else None, norm.weight, norm.eps)
            ops.ffn_block(c_layer, h, layer.attention(x, rotation, batch), delta, scratch, batch.adapters)
            layer.feed_forward.w2.communicate(delta)
        return h + delta

    def _decode(self, structs: ctypes.Array, h: torch.Tensor, rotation: torch.Tensor, batch: Batch,
                scratch: torch.Tensor) -> torch.Tensor:
        """Every token as a decode row: a row's proposals (n_verify) each a row of its own at its position,
        all keys written before any row attends."""
        own = batch.n_verify > 0
        tables = batch.tables_of(len(h))  # alive for the calls
        rows = ops.decode_rows(rotation, tables, batch.positions, batch.adapters)
        first = self[0].attention
        if first.wo.comm == NONE:
            ops.decode_stack(structs, rows, h, scratch, first.cache.k, write_first=own)
            return h
        delta = torch.empty_like(h)
        for i, (layer, c_layer) in enumerate(zip(self, structs)):
            attention, ffn = layer.attention, layer.feed_forward
            ops.attention_block(c_layer, rows, h, delta if i else None, delta, scratch, attention.cache.k,
                                write_first=own)
            attention.wo.communicate(delta)
            ops.ffn_block(c_layer, h, delta, delta, scratch, batch.adapters)
            ffn.w2.communicate(delta)
        return h + delta

    def forget_plan(self) -> None:
        """Plan the C layers again before the next step (their adapters changed)."""
        self._planned = None

    def _structs(self) -> ctypes.Array | None:
        """The layers as C structs, planned again whenever the caches they point into were replaced."""
        caches = [layer.attention.cache for layer in self]
        if self._planned is None or any(a is not b for a, b in zip(self._planned[0], caches)):
            self._planned = (caches, self._plan())
        return self._planned[1]

    def _plan(self) -> ctypes.Array | None:
        planned = []
        for layer in self:
            attention, ffn = layer.attention, layer.feed_forward
            if not (isinstance(attention, CAttention) and isinstance(ffn, GatedFeedForward)
                    and isinstance(layer.attention_norm, CRMSNorm) and attention.cache is not None
                    and {attention.wo.comm, ffn.w2.comm} <= {NONE, ALL_REDUCE}):
                return None
            adapted = (attention.lora_qkv, attention.wo.lora, ffn.lora_w13, ffn.w2.lora)
            c_layer = ops.decode_layer((layer.attention_norm.weight, layer.ffn_norm.weight),
                                       (attention.wqkv, attention.wo.weight, ffn.w13, ffn.w2.weight),
                                       attention.cache.k, attention.cache.v, attention.cache.block_size,
                                       layer.attention_norm.eps,
                                       lora=tuple(p and p.weights.c for p in adapted) if any(adapted) else None)
            if c_layer is None:
                return None
            planned.append(c_layer)
        return ops.decode_layers(planned)


def apply_layer(block: nn.Module, kind: str, bits: int = 16) -> None:
    """One block's projections fused into the C kernels' forms ("tiles" or "amx"; bits 8 or 4: their
    integer tiles), and their modules swapped in."""
    c_attention = block.attention.head_dim <= library().constants["MAX_HEAD_DIM"]
    block.attention = (CAttention if c_attention else FusedAttention)(block.attention, kind, bits=bits)
    block.feed_forward = feed_forward(block.feed_forward, kind, bits)
    block.attention_norm, block.ffn_norm = CRMSNorm(block.attention_norm), CRMSNorm(block.ffn_norm)


def apply_top(model: Transformer, kind: str, bits: int = 16) -> None:
    """The final norm and output layer, and the blocks' C decode layers, once every block is applied."""
    model.norm = CRMSNorm(model.norm)
    model.output = serving_linear(model.output, kind, bits=bits)
    model.layers = DecodeLayers(model.layers)
