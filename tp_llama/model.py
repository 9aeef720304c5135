"""The Llama transformer, in Meta's parameter names and rotary convention.

Head counts are never stored: attention infers them from the projection widths, so the same code
runs whole on one process and with column-sharded wq/wk/wv under tensor parallelism.

A forward runs one `Batch`: the tokens of every row flattened into one sequence, so the
projections and the FFN see one matrix whatever mix of prefill chunks and decode steps the
scheduler planned. Only attention looks at rows: decode rows together, prefill rows one by one.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tp_llama import kernels
from tp_llama.kernels import Tiled, linear, matmul_kind, prepare
from tp_llama.layout import ALL_REDUCE, NONE
from tp_llama.parallel import LocalLinear
from tp_llama.params import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = False  # cpu_layer.c's rms_norm, with the tiled matmuls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def fused_weight(modules: list[nn.Module], kind: str) -> torch.Tensor | Tiled:
    """One weight for several projections of the same input, so that they run as one matmul."""
    return prepare(torch.cat([m.weight.detach() for m in modules]), kind, own=True)


def as_local_linear(module: nn.Module, kind: str) -> LocalLinear:
    """A LocalLinear in place of a plain Linear (TP 1), its weight prepared for `kind` of matmul."""
    local = module if isinstance(module, LocalLinear) else LocalLinear(module.weight.detach(), NONE, None)
    local.prepare(kind)
    return local


def rope_frequencies(head_dim: int, theta: float, use_scaled_rope: bool) -> torch.Tensor:
    """Per-pair rotation speeds; Llama 3.1 stretches the slow ones for its long context."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not use_scaled_rope:
        return freqs
    factor, low_freq_factor, high_freq_factor, old_context = 8.0, 1.0, 4.0, 8192.0
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > old_context / low_freq_factor, freqs / factor, blended)
    return torch.where(wavelen < old_context / high_freq_factor, freqs, scaled)


def rope_table(args: ModelArgs, max_seq_len: int, device: torch.device) -> torch.Tensor:
    """Unit complex numbers [max_seq_len, head_dim/2]: the rotation of each pair at each position."""
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.use_scaled_rope)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent element pairs (Meta's complex-multiply convention). x [T, h, hd], rotation [T, 1, hd/2]."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


@dataclass
class Batch:
    """One forward: token t sits at positions[t] of cache slot slots[t].

    The first `n_decode` tokens are decode rows (one token each, slots ascending) that attend
    together over the cache slots [decode_lo, decode_hi); `prefill` lists the other rows as
    (first token index, slot, start position, length). Logits come back for the tokens at
    `logits_at` only.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits_at: torch.Tensor
    n_decode: int
    decode_lo: int
    decode_hi: int
    decode_rows: torch.Tensor | None  # slot - decode_lo of each decode token; None when they fill the range
    decode_mask: torch.Tensor | None  # [hi-lo, 1, 1, kv_len] keys each slot of the range may see
    prefill: list[tuple[int, int, int, int]]

    @classmethod
    def build(cls, rows: list[tuple[int, int, list[int], bool]], device: torch.device, all_logits: bool = False) -> Batch:
        """rows: (slot, start position, tokens, want the logits of its last token); a row of one token decodes.

        Everything is computed on the host from Python ints: no device sync in the forward.
        """
        order = sorted(range(len(rows)), key=lambda i: (len(rows[i][2]) > 1, rows[i][0] if len(rows[i][2]) == 1 else i))
        decode = [rows[i] for i in order if len(rows[i][2]) == 1]
        tokens, positions, slots, prefill = [], [], [], []
        first = [0] * len(rows)
        for i in order:
            slot, start, ids, _ = rows[i]
            first[i] = len(tokens)
            if len(ids) > 1:
                prefill.append((len(tokens), slot, start, len(ids)))
            tokens += ids
            positions += range(start, start + len(ids))
            slots += [slot] * len(ids)
        # Logits in the caller's row order, whatever order the tokens run in.
        logits_at = []
        for i, (_, _, ids, want) in enumerate(rows):
            if all_logits:
                logits_at += range(first[i], first[i] + len(ids))
            elif want:
                logits_at.append(first[i] + len(ids) - 1)
        lo = decode[0][0] if decode else 0
        hi = decode[-1][0] + 1 if decode else 0
        decode_rows, decode_mask = None, None
        if decode:
            kv_len = max(start for _, start, _, _ in decode) + 1
            seen = torch.zeros(hi - lo, dtype=torch.long)  # a hole in the range sees key 0 only
            index = torch.tensor([slot - lo for slot, *_ in decode])
            seen[index] = torch.tensor([start for _, start, _, _ in decode])
            decode_mask = (torch.arange(kv_len) <= seen.unsqueeze(1)).view(hi - lo, 1, 1, kv_len).to(device)
            if len(decode) != hi - lo:
                decode_rows = index.to(device)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(
            as_tensor(tokens), as_tensor(positions), as_tensor(slots), as_tensor(logits_at),
            len(decode), lo, hi, decode_rows, decode_mask, prefill,
        )


class KVCache:
    """Keys and values of every slot [slots, kv_heads, max_seq_len, head_dim] (this rank's heads)."""

    def __init__(self, slots: int, max_seq_len: int, n_kv_heads: int, head_dim: int, dtype, device):
        shape = (slots, n_kv_heads, max_seq_len, head_dim)
        # Written now, so every page is resident from the start: a cache that does not fit fails
        # at load, and memory stays flat while serving.
        self.k = torch.empty(shape, dtype=dtype, device=device).zero_()
        self.v = torch.empty(shape, dtype=dtype, device=device).zero_()

    def write(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, kv_heads, hd] of T tokens, at their slots and positions."""
        self.k[slots, :, positions] = k
        self.v[slots, :, positions] = v


def _prefill_mask(start: int, length: int, device: torch.device) -> torch.Tensor:
    """Query i (at position start + i) sees keys 0 .. start + i."""
    keys = torch.arange(start + length, device=device)
    return keys <= (start + torch.arange(length, device=device)).unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.cache: KVCache | None = None
        self.wqkv: torch.Tensor | Tiled | None = None
        self.widths = (0, 0)  # q and k features of this rank, once fused
        self.fused = False  # decode rows through cpu_layer.c's decode_attention

    def optimize(self, kind: str) -> None:
        """q, k and v as one matmul; the separate projections go (inference only from then on)."""
        self.widths = (self.wq.weight.shape[0], self.wk.weight.shape[0])
        self.wqkv = fused_weight([self.wq, self.wk, self.wv], kind)
        del self.wq, self.wk, self.wv
        self.wo = as_local_linear(self.wo, kind)
        self.fused = kind == "tiles" and self.head_dim <= kernels.MAX_HEAD_DIM

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, batch: Batch) -> torch.Tensor:
        hd = self.head_dim
        if self.wqkv is None:  # FSDP (or the DTensor test oracle) owns the weights: three matmuls
            q, k, v = (w(x).unflatten(-1, (-1, hd)) for w in (self.wq, self.wk, self.wv))
            out = self._attend(apply_rope(q, rotation), apply_rope(k, rotation), v, batch, 0)
            return self.wo(out.flatten(1))
        qkv = linear(x, self.wqkv)
        done = batch.n_decode if self.fused else 0  # tokens whose attention is out already
        out = qkv.new_empty((qkv.shape[0], self.widths[0]))
        if done:
            kernels.decode_attention(qkv[:done], rotation[:done], batch.slots[:done], batch.positions[:done],
                                     self.cache.k, self.cache.v, out[:done])
        if done < qkv.shape[0]:
            n_q, n_kv = self.widths
            qk = apply_rope(qkv[done:, : n_q + n_kv].unflatten(-1, (-1, hd)), rotation[done:])
            q, k = qk.split([n_q // hd, n_kv // hd], dim=1)
            out[done:] = self._attend(q, k, qkv[done:, n_q + n_kv :].unflatten(-1, (-1, hd)), batch, done).flatten(1)
        return self.wo(out)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, done: int) -> torch.Tensor:
        """Attention of the batch's tokens from `done` on (q, k rotated), their keys and values cached first."""
        self.cache.write(batch.slots[done:], batch.positions[done:], k, v)
        if not batch.prefill:
            return self._decode(q, batch)
        if not batch.n_decode and len(batch.prefill) == 1:
            return self._prefill(q, *batch.prefill[0][1:])
        out = torch.empty_like(q)
        if batch.n_decode > done:
            out[: batch.n_decode] = self._decode(q[: batch.n_decode], batch)
        for first, slot, start, length in batch.prefill:
            first -= done
            out[first : first + length] = self._prefill(q[first : first + length], slot, start, length)
        return out

    def _decode(self, q: torch.Tensor, batch: Batch) -> torch.Tensor:
        """One query per slot of [lo, hi) against that slot's cache; holes get a dummy query."""
        kv_len = batch.decode_mask.shape[-1]
        keys = self.cache.k[batch.decode_lo : batch.decode_hi, :, :kv_len]
        values = self.cache.v[batch.decode_lo : batch.decode_hi, :, :kv_len]
        if batch.decode_rows is None:
            queries = q.unsqueeze(2)
        else:
            queries = q.new_zeros((batch.decode_hi - batch.decode_lo, *q.shape[1:])).unsqueeze(2)
            queries[batch.decode_rows] = q.unsqueeze(2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.decode_mask, enable_gqa=True)
        out = out.squeeze(2)
        return out if batch.decode_rows is None else out[batch.decode_rows]

    def _prefill(self, q: torch.Tensor, slot: int, start: int, length: int) -> torch.Tensor:
        keys = self.cache.k[slot : slot + 1, :, : start + length]
        values = self.cache.v[slot : slot + 1, :, : start + length]
        queries = q.transpose(0, 1).unsqueeze(0)
        if start == 0:
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
        else:
            mask = _prefill_mask(start, length, q.device)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w13: torch.Tensor | Tiled | None = None

    def optimize(self, kind: str) -> None:
        """w1 and w3 as one matmul (ending in SwiGLU with the tiles); the projections go (inference only)."""
        gated = kernels.prepare_swiglu(self.w1.weight, self.w3.weight, kind)
        self.w13 = gated if gated is not None else fused_weight([self.w1, self.w3], kind)
        del self.w1, self.w3
        self.w2 = as_local_linear(self.w2, kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is None:  # FSDP owns the weights' memory
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if isinstance(self.w13, Tiled) and self.w13.gated:  # the matmul ends in silu(gate) * up
            return self.w2(linear(x, self.w13))
        gate, up = linear(x, self.w13).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, batch: Batch) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotation, batch)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_seq_len = 0
        self.max_batch_size = 0
        self.decode_layers: ctypes.Array | None = None  # of kernels.DecodeLayer, see _plan_decode_layers

    def setup_caches(
        self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype, device: torch.device, tp_size: int = 1
    ) -> None:
        """Allocate the KV cache (max_batch_size slots, this rank's KV heads) and the RoPE table."""
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.rope = rope_table(self.args, max_seq_len, device)
        n_local_kv_heads = self.args.n_kv_heads // tp_size
        for layer in self.layers:
            attn = _unwrap(layer).attention
            attn.cache = KVCache(max_batch_size, max_seq_len, n_local_kv_heads, self.args.head_dim, dtype, device)
        self._plan_decode_layers()

    def optimize_for_inference(self) -> tuple[str, str]:
        """Fewer, faster matmuls for serving: q/k/v and w1/w3 fused, weights prepared for the CPU's kernels.

        Only for weights this process owns (not under FSDP). The model no longer holds Meta's
        separate projections afterwards, so take any state_dict before. Returns kernels.matmul_kind's
        (kind, why not a faster one).
        """
        kind, why = matmul_kind(self.norm.weight.device, self.norm.weight.dtype)
        for layer in self.layers:
            layer.attention.optimize(kind)
            layer.feed_forward.optimize(kind)
            layer.attention_norm.fused = layer.ffn_norm.fused = kind == "tiles"
        self.norm.fused = kind == "tiles"
        self.output = as_local_linear(self.output, kind)
        self._plan_decode_layers()
        return kind, why

    def _plan_decode_layers(self) -> None:
        """Decode-only steps' layers as C calls (cpu_decode.c), where the weights and cache allow it.

        It needs the tiled kernels (optimize_for_inference) and the cache (setup_caches), whichever
        comes last; otherwise decode steps run op by op, as every other step does.
        """
        self.decode_layers = None
        layers = [_unwrap(layer) for layer in self.layers]
        if not all(layer.attention.fused and layer.attention.cache is not None for layer in layers):
            return
        planned = []
        for layer in layers:
            attn, ffn = layer.attention, layer.feed_forward
            if {attn.wo.comm, ffn.w2.comm} - {NONE, ALL_REDUCE}:
                return
            c_layer = kernels.decode_layer((layer.attention_norm.weight, layer.ffn_norm.weight),
                                           (attn.wqkv, attn.wo.weight, ffn.w13, ffn.w2.weight),
                                           attn.cache.k, attn.cache.v, layer.attention_norm.eps)
            if c_layer is None:
                return
            planned.append(c_layer)
        self.decode_layers = (kernels.DecodeLayer * len(planned))(*planned)

    def matmul_weights(self) -> list[torch.Tensor | Tiled]:
        weights = [self.output.weight]
        for layer in self.layers:
            attn, ffn = layer.attention, layer.feed_forward
            weights += [attn.wqkv, attn.wo.weight, ffn.w13, ffn.w2.weight]
        return weights

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [len(batch.logits_at), V] (float32) of the tokens the batch asks for."""
        rotation = self.rope[batch.positions].unsqueeze(1)
        h = self.tok_embeddings(batch.tokens)
        if self.decode_layers is not None and 0 < batch.n_decode == len(batch.tokens):
            h = self._decode_layers(h, rotation, batch)
        else:
            for layer in self.layers:
                h = layer(h, rotation, batch)
        return self.output(self.norm(h[batch.logits_at])).float()

    def _decode_layers(self, h: torch.Tensor, rotation: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The layers of a decode-only step in C: one call for them all, or under tensor parallelism two
        per layer with the all-reduces between them.

        Each half-layer call first adds the previous one's output (delta) to the residual stream h, in place.
        """
        rows = kernels.decode_rows(rotation, batch.slots, batch.positions)
        scratch = kernels.decode_scratch(self.decode_layers[0], len(h))
        h = h.contiguous()
        first = self.layers[0].attention
        if first.wo.comm == NONE:
            kernels.decode_stack(self.decode_layers, rows, h, scratch, first.cache.k)
            return h
        delta = torch.empty_like(h)
        for i, (layer, c_layer) in enumerate(zip(self.layers, self.decode_layers)):
            attn, ffn = layer.attention, layer.feed_forward
            kernels.attention_block(c_layer, rows, h, delta if i else None, delta, scratch, attn.cache.k)
            attn.wo.communicate(delta)
            kernels.ffn_block(c_layer, h, delta, delta, scratch)
            ffn.w2.communicate(delta)
        return h + delta


def dense_logits(
    model: nn.Module, tokens: torch.Tensor, start_pos: torch.Tensor, first_slot: int = 0, last_only: bool = True
) -> torch.Tensor:
    """Row b of tokens [B, S] at positions start_pos[b].. in cache slot first_slot + b, as one Batch.

    Returns logits [B, V] of each row's last position (or [B, S, V] with last_only=False).
    """
    bsz, seqlen = tokens.shape
    slots = range(first_slot, first_slot + bsz)
    spec = [(slot, int(start), ids, True) for slot, start, ids in zip(slots, start_pos.tolist(), tokens.tolist())]
    logits = model(Batch.build(spec, tokens.device, all_logits=not last_only))
    return logits if last_only else logits.view(bsz, seqlen, -1)


def _unwrap(module: nn.Module) -> nn.Module:
    """FSDP1 wraps each block; the attention lives on the inner module."""
    return getattr(module, "_fsdp_wrapped_module", module)
