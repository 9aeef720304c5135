"""Llama 4's blocks prepared for serving: their matmuls in the kernels' forms, the experts one weight each.

q/k/v run as one matmul and the FFNs' w1/w3 as one (with the C kernels, tiles that end in SwiGLU), as
for Llama 2/3 (backend/fused.py, backend/cpu.py); iRoPE's steps between the projections and attention
stay PyTorch's (model/llama4.py). With the C kernels the attention then runs in C as Llama 2/3's does
(decode rows one C call, within their window on the chunked layers; prompt chunks a piece per window),
so that a row's bits do not depend on the rows beside it (PyTorch's attention pads decode rows to the
longest, which moves their bits).

Each routed expert is a feed-forward of its own, so a decode row reads
only the weights of the expert it was routed to, and a prompt step reads each chosen expert's weights
once for all its rows. The router runs on the same kernels, so with the C kernels a row's expert and
result do not depend on the rows beside it (their tiles compute each row alone).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from tp_llama.backend import cpu
from tp_llama.backend.fused import FusedAttention, FusedFeedForward, held
from tp_llama.kernels import C_KINDS, linear, prepare
from tp_llama.kernels.cpu import ops
from tp_llama.kernels.cpu.ffi import library
from tp_llama.model.batch import Batch
from tp_llama.model.llama import FeedForward
from tp_llama.model.llama4 import Llama4Attention, Llama4Block, MoE, each_expert, grouped_experts, route
from tp_llama.parallel.layout import NONE
from tp_llama.parallel.modules import LocalLinear


class ServingAttention(FusedAttention):
    """Llama 4's attention with q, k and v in one matmul. With the C kernels, after iRoPE's steps: decode and
    verifying rows in one C call, within their windows; prompt chunks as CAttention runs them (backend/cpu.py),
    each cut at its windows' ends."""

    def __init__(self, attention: Llama4Attention, kind: str, device: torch.device | None = None, bits: int = 16):
        super().__init__(attention, kind, device, bits)
        self.irope = attention.irope
        self.in_c = kind in C_KINDS and self.head_dim <= library().constants["MAX_HEAD_DIM"]
        self._unrotated = torch.empty(0)  # C's RoPE as 1 + 0i for the rows of a step, grown to the most it has seen

    def attend(self, qkv: torch.Tensor, rotation: torch.Tensor, batch: Batch, done: int = 0) -> torch.Tensor:
        n_q, n_kv = self.widths
        q, k, v = (part.unflatten(-1, (-1, self.head_dim)) for part in qkv.split([n_q, n_kv, n_kv], dim=1))
        window, cache = self.irope.window, self.cache
        if not self.in_c or (window is not None and window % cache.block_size):
            return self.irope.attend(cache, q, k, v, rotation, batch).flatten(1)
        q, k = self.irope.query_and_key(q, k, rotation, batch)
        ready = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=1)  # rotated already: C's RoPE is 1 + 0i
        out = ready.new_empty((len(ready), n_q))
        rows = cpu.decode_tokens(batch, ready.dtype, self.head_dim)
        if rows:
            self._as_decode_rows(ready[:rows], batch.tables_of(rows), batch.positions[:rows], out[:rows],
                                 rows > batch.n_decode)
        if rows < len(ready):
            cache.write(batch.locations[rows:], k[rows:], v[rows:])
            for first, row, start, length in batch.prefill:
                if first >= rows:
                    self._prompt_chunk(ready, batch, first, row, start, length, out)
        return out

    def _as_decode_rows(self, ready: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
                        write_first: bool) -> None:
        """Each row of `ready` (q, k, v rotated) a decode row at its position (decode_attention's write_first)."""
        if len(self._unrotated) < len(ready):
            self._unrotated = torch.tensor([1.0, 0.0]).repeat(len(ready), self.head_dim // 2)
        cache, rows = self.cache, ops.decode_rows(self._unrotated[: len(ready)], tables, positions)
        ops.decode_attention(ready, rows, cache.k, cache.v, cache.block_size, out, write_first=write_first,
                             window=self.irope.window)

    def _prompt_chunk(self, ready: torch.Tensor, batch: Batch, first: int, row: int, start: int, length: int,
                      out: torch.Tensor) -> None:
        """A prompt chunk (its keys written) through prompt_attention.c, a piece per window it spans: a piece
        attends over the blocks from its window's first on, as a sequence that starts there."""
        window, cache, n_heads = self.irope.window, self.cache, self.widths[0] // self.head_dim
        at = start
        while at < start + length:
            opened = at - at % window if window else 0
            end = min(start + length, opened + window) if window else start + length
            rows = slice(first + at - start, first + end - start)
            table = batch.tables[row, opened // cache.block_size :]
            if not ops.prompt_attention(ready[rows], n_heads, self.head_dim, cache.k, cache.v, cache.block_size, table,
                                        at - opened, out[rows]):
                tables = batch.tables[row : row + 1].expand(end - at, -1).contiguous()
                self._as_decode_rows(ready[rows], tables, batch.positions[rows], out[rows], True)
            at = end


def feed_forward(ffn: FeedForward | SimpleNamespace, kind: str, device: torch.device | None, bits: int) -> nn.Module:
    """A SwiGLU with w1/w3 fused: the C kernels' gated tiles where they run, else one fused matmul."""
    if kind in C_KINDS:
        return cpu.feed_forward(ffn, kind, bits)
    return FusedFeedForward(ffn, kind, device, bits)


class ServingMoE(nn.Module):
    """The MoE's router, shared expert and routed experts as prepared weights (the routing: model/llama4.py).

    Where PyTorch's matmuls run unquantized (`plain`: CUDA GPUs) the experts stay stacked for grouped matmuls
    (`grouped`), which a CUDA graph can capture; elsewhere each expert is a feed-forward of its own.
    """

    def __init__(self, moe: MoE, kind: str, device: torch.device | None, bits: int):
        super().__init__()
        self.group = moe.group
        # The router stays at the model's precision at any `bits`: its scores pick the expert.
        self.router = held(prepare(moe.router_DE.detach().t().contiguous(), kind, device, 16))
        self.shared_expert = feed_forward(moe.shared_expert, kind, device, bits)
        experts, count = moe.experts, len(moe.experts.w1)
        # Tokens routed to each expert since load (prompt, generated and verified ones), for the metrics.
        self.register_buffer("tokens_per_expert", torch.zeros(count, dtype=torch.long), persistent=False)
        self.routed = nn.ModuleList()
        dim, width = experts.w1[0].shape
        self.grouped = kind == "plain" and bits == 16 and groupable(experts.w1[0].dtype, device)
        if self.grouped:
            w13 = torch.empty(count, dim, 2 * width, dtype=experts.w1[0].dtype)
            w2 = torch.empty(count, width, dim, dtype=experts.w2[0].dtype)
        # One expert at a time, each dropped once prepared: a load holds the layer's prepared experts and one
        # as read (their widths are the shared expert's, whose groups Preparation.layer checked).
        for e in range(count):
            w1_e, w3_e, w2_e = (take(getattr(experts, w), e) for w in ("w1", "w3", "w2"))
            if self.grouped:
                w13[e, :, :width], w13[e, :, width:], w2[e] = w1_e, w3_e, w2_e
                continue
            parts = {"w1": w1_e.t(), "w3": w3_e.t(), "w2": w2_e.t()}  # as Linear weights [out, in]
            ffn = SimpleNamespace(**{w: LocalLinear(weight.contiguous(), NONE, None) for w, weight in parts.items()})
            self.routed.append(feed_forward(ffn, kind, device, bits))
        if self.grouped:
            self.w13, self.w2 = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = grouped_experts(self.w13, self.w2) if self.grouped else each_expert(self.expert)
        return route(x, linear(x, self.router), self.shared_expert, experts, self.group, self.tokens_per_expert)

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return self.routed[e](x)


def groupable(dtype: torch.dtype, device: torch.device | None) -> bool:
    """PyTorch's grouped matmul runs on CPUs, and on CUDA GPUs in bfloat16 (compute capability 8.0 on)."""
    if device is None or device.type == "cpu":
        return True
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)


def take(weights: nn.ParameterList, e: int) -> torch.Tensor:
    """weights[e], its place in the list emptied (the tensor is freed once its caller drops it)."""
    weight = weights[e].detach()
    weights[e] = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
    return weight


def apply_layer(block: Llama4Block, kind: str, device: torch.device | None, bits: int) -> None:
    """One Llama 4 block's serving modules, every matmul weight prepared for `kind`, quantized to `bits`."""
    block.attention = ServingAttention(block.attention, kind, device, bits)
    if isinstance(block.feed_forward, MoE):
        block.feed_forward = ServingMoE(block.feed_forward, kind, device, bits)
    else:
        block.feed_forward = feed_forward(block.feed_forward, kind, device, bits)
    if kind in C_KINDS:
        block.attention_norm, block.ffn_norm = cpu.CRMSNorm(block.attention_norm), cpu.CRMSNorm(block.ffn_norm)

