"""The Llama transformer, in Meta's parameter names and rotary convention; the math and nothing else.

Head counts are never stored: attention infers them from the projection widths, so the same code
runs whole on one process and with column-sharded wq/wk/wv under tensor parallelism (the
parallel layer swaps the Linears for local shards with their collectives). Serving backends
swap modules in after the model is built (tp_llama.backend), gpt-fast's way: this file has no
backend flags.

A forward runs one `Batch`: the tokens of every row flattened into one sequence, so the
projections and the FFN see one matrix whatever mix of prefill chunks and decode steps the
scheduler planned. Only attention looks at rows (tp_llama.model.kv_cache).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tp_llama.model.args import ModelArgs
from tp_llama.model.batch import Batch
from tp_llama.model.kv_cache import KVCache, attend


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_frequencies(head_dim: int, theta: float, use_scaled_rope: bool,
                     scaling: tuple[float, float] = (8.0, 4.0)) -> torch.Tensor:
    """Per-pair rotation speeds; Llama 3.1 and Llama 4 Scout stretch the slow ones for their long context
    (scaling: the factor and the high-frequency factor, ModelArgs.rope_scaling)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not use_scaled_rope:
        return freqs
    (factor, high_freq_factor), low_freq_factor, old_context = scaling, 1.0, 8192.0
    wavelen = 2 * math.pi / freqs
    # Scout's factors are equal: no band is blended, and the division would make nans it never picks.
    smooth = (old_context / wavelen - low_freq_factor) / max(high_freq_factor - low_freq_factor, 1e-9)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > old_context / low_freq_factor, freqs / factor, blended)
    return torch.where(wavelen < old_context / high_freq_factor, freqs, scaled)


def rope_table(args: ModelArgs, max_seq_len: int, device: torch.device) -> torch.Tensor:
    """(cos, sin) [max_seq_len, head_dim/2, 2] in float32: the rotation of each pair at each position.

    Real pairs rather than complex numbers: the same bytes as complex64, which compilers fuse and
    the C kernels read as they are.
    """
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.use_scaled_rope, args.rope_scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float().to(device)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent element pairs (Meta's complex-multiply convention). x [T, h, hd], rotation [T, 1, hd/2, 2].

    Eager, as one complex multiply (one kernel where the real pairs take six ops, bench/engine/step.py);
    traced, as real pairs, which inductor fuses.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    if not torch.compiler.is_compiling():
        rotated = torch.view_as_complex(pairs) * torch.view_as_complex(rotation)
        return torch.view_as_real(rotated).flatten(-2).to(x.dtype)
    real, imag = pairs.unbind(-1)
    cos, sin = rotation.unbind(-1)
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, batch: Batch) -> torch.Tensor:
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)) for w in (self.wq, self.wk, self.wv))
        out = attend(self.cache, apply_rope(q, rotation), apply_rope(k, rotation), v, batch)
        return self.wo(out.flatten(1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, hidden: int | None = None):
        super().__init__()
        hidden = args.ffn_dim if hidden is None else hidden  # Llama 4's shared expert has the experts' width
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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


class Layers(nn.ModuleList):
    """The blocks, run one after the other (a backend may run a whole step of them at once)."""

    def forward(self, h: torch.Tensor, rotation: torch.Tensor, batch: Batch) -> torch.Tensor:
        for layer in self:
            h = layer(h, rotation, batch)
        return h


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, block: Callable[[ModelArgs, int], nn.Module] | None = None):
        """block(args, layer): the family's block (tp_llama.model.build chooses it from params.json)."""
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        block = block or (lambda args, layer: TransformerBlock(args))
        self.layers = Layers(block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rope: torch.Tensor | None = None

    def setup_caches(self, max_seq_len: int, n_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device, n_kv_heads: int | None = None) -> None:
        """A KV cache of `n_blocks` blocks of `block_size` positions for each layer (plus the spare
        block), and the RoPE table of max_seq_len positions.

        n_kv_heads: the KV heads this process holds (all of them unless the model is sharded).
        """
        self.rope = rope_table(self.args, max_seq_len, device)
        heads = self.args.n_kv_heads if n_kv_heads is None else n_kv_heads
        for layer in self.layers:  # FSDP1's wrapper passes attribute reads through to the block
            layer.attention.cache = KVCache(n_blocks, block_size, heads, self.args.head_dim, dtype, device)

    def share_caches(self, other: Transformer) -> None:
        """Read and write `other`'s KV caches and RoPE table: a model of the same shapes run on the same
        sequences (the int4 self-draft, engine/draft.py)."""
        self.rope = other.rope
        for mine, theirs in zip(self.layers, other.layers):
            mine.attention.cache = theirs.attention.cache

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [len(batch.logits_at), V] (float32) of the tokens the batch asks for."""
        return self.output(self.hidden(batch)).float()

    def hidden(self, batch: Batch) -> torch.Tensor:
        """The final norm's output [len(batch.logits_at), dim] of the tokens the batch asks for: what the
        output layer reads (prompt log-probabilities reduce its logits a slice at a time)."""
        rotation = self.rope[batch.positions].unsqueeze(1)
        h = self.layers(self.tok_embeddings(batch.tokens), rotation, batch)
        return self.norm(h[batch.logits_at])
