"""The model's hyper-parameters, with what Meta's params.json leaves implicit worked out."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MoEArgs:
    """Llama 4's routed experts: every `interleave`-th layer's FFN is `experts` SwiGLUs of width
    `expert_dim` (top-1 routed) beside a shared one of the same width."""

    experts: int
    expert_dim: int
    interleave: int = 1


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    use_scaled_rope: bool = False
    # Llama 1/2 write vocab_size -1 (taken from the tokenizer); Llama 3 writes it out; Llama 4 adds moe_args.
    family: str = "llama2"
    # (factor, high-frequency factor) of the scaled RoPE: Llama 3.1's 8 and 4 (Llama 3.2 1B / 3B: 32 and 4),
    # Llama 4 Scout's 16 and 1.
    rope_scaling: tuple[float, float] = (8.0, 4.0)
    # Llama 4 (iRoPE): every nope_layer_interval-th layer attends globally without RoPE (its query
    # scaled by position where attn_temperature_tuning), the others with RoPE then a weightless
    # RMSNorm of q and k (use_qk_norm), within blocks of attention_chunk_size positions.
    moe: MoEArgs | None = None
    nope_layer_interval: int | None = None
    use_qk_norm: bool = False
    attention_chunk_size: int | None = None
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_nope_layer(self, layer: int) -> bool:
        return self.nope_layer_interval is not None and (layer + 1) % self.nope_layer_interval == 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and (layer + 1) % self.moe.interleave == 0


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU width as Meta computes it: 2/3 of 4*dim, scaled, rounded up to multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def expert_hidden_dim(dim: int, ffn_exp: float, ffn_dim_multiplier: float, multiple_of: int,
                      capacity_factor: float, auto_scale: bool) -> int:
    """Llama 4's expert (and shared expert) width as llama-models computes it: 2/3 of ffn_exp * dim, scaled,
    divided by capacity_factor + 1 where auto_scale_F, rounded up to multiple_of."""
    hidden = int(ffn_dim_multiplier * int(2 * int(ffn_exp * dim) / 3))
    if auto_scale:
        hidden = int(hidden / (capacity_factor + 1))
    return hidden + -hidden % multiple_of
