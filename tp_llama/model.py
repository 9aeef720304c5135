"""The Llama transformer, in Meta's parameter names and rotary convention.

Head counts are never stored: attention infers them from the projection widths, so the same code
runs whole on one process and with column-sharded wq/wk/wv under tensor parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tp_llama.params import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


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


def rope_table(args: ModelArgs, max_seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.use_scaled_rope)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent element pairs (Meta's complex-multiply convention). cos/sin: [B, S, 1, hd/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class KVCache:
    """Keys and values for max_batch_size rows of max_seq_len positions (this rank's heads)."""

    def __init__(self, max_batch_size: int, max_seq_len: int, n_kv_heads: int, head_dim: int, dtype, device):
        shape = (max_batch_size, max_seq_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, rows: slice, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int):
        """Write k/v [B, S, h, hd] at positions [B, S]; return all keys/values up to kv_len."""
        batch_index = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
        cache_k, cache_v = self.k[rows], self.v[rows]
        cache_k[batch_index, positions] = k
        cache_v[batch_index, positions] = v
        return cache_k[:, :kv_len], cache_v[:, :kv_len]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x, cos, sin, rows: slice, positions, mask, kv_len: int) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).unflatten(-1, (-1, self.head_dim))
        k = self.wk(x).unflatten(-1, (-1, self.head_dim))
        v = self.wv(x).unflatten(-1, (-1, self.head_dim))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = self.cache.update(rows, positions, k, v, kv_len)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, rows, positions, mask, kv_len) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, rows, positions, mask, kv_len)
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

    def setup_caches(
        self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype, device: torch.device, tp_size: int = 1
    ) -> None:
        """Allocate the KV cache (this rank's KV heads) and RoPE table; they are not weights."""
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.rope_cos, self.rope_sin = rope_table(self.args, max_seq_len, device)
        n_local_kv_heads = self.args.n_kv_heads // tp_size
        for layer in self.layers:
            attn = _unwrap(layer).attention
            attn.cache = KVCache(max_batch_size, max_seq_len, n_local_kv_heads, self.args.head_dim, dtype, device)

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, rows: slice, last_only: bool = True) -> torch.Tensor:
        """Run tokens [B, S]; row b sits at positions start_pos[b] .. start_pos[b]+S-1 in cache rows `rows`.

        Returns logits [B, V] of the last position (or [B, S, V] with last_only=False).
        """
        seqlen = tokens.shape[1]
        positions = start_pos.unsqueeze(1) + torch.arange(seqlen, device=tokens.device)
        kv_len = int(positions.max()) + 1
        mask = (torch.arange(kv_len, device=tokens.device) <= positions.unsqueeze(-1)).unsqueeze(1)
        cos = self.rope_cos[positions].unsqueeze(2)
        sin = self.rope_sin[positions].unsqueeze(2)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, rows, positions, mask, kv_len)
        if last_only:
            h = h[:, -1:]
        logits = self.output(self.norm(h)).float()
        return logits[:, -1] if last_only else logits


def _unwrap(module: nn.Module) -> nn.Module:
    """FSDP1 wraps each block; the attention lives on the inner module."""
    return getattr(module, "_fsdp_wrapped_module", module)

