"""Running a model under test on plain [B, S] token tensors."""

from __future__ import annotations

import torch
from torch import nn

from tp_llama.model import dense_batch


def dense_logits(model: nn.Module, tokens: torch.Tensor, start_pos: torch.Tensor, first_slot: int = 0,
                 last_only: bool = True) -> torch.Tensor:
    """Row b of tokens [B, S] at positions start_pos[b].. in cache slot first_slot + b, as one Batch.

    Returns logits [B, V] of each row's last position (or [B, S, V] with last_only=False), on the
    host whichever device the model runs on.
    """
    device = next(model.parameters()).device
    logits = model(dense_batch(tokens, start_pos, first_slot, last_only, device)).cpu()
    return logits if last_only else logits.view(*tokens.shape, logits.shape[-1])
