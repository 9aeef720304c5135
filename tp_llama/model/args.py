"""The model's hyper-parameters, with what Meta's params.json leaves implicit worked out."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
    # Llama 1/2 write vocab_size -1 (taken from the tokenizer); Llama 3 writes it out.
    family: str = "llama2"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU width as Meta computes it: 2/3 of 4*dim, scaled, rounded up to multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)
