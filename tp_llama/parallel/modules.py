"""Tensor-parallel modules: this rank's shard of a weight, then the collective its split needs.

The `tp` mode runs plain local shards (LocalLinear, LocalEmbedding) with explicit collectives,
each taken from layout.TP_TABLE; the loader builds them straight from the file slices (DTensor's
per-op Python dispatch costs more than a CPU decode step's matmuls). They run whatever form a
backend gave their weight (tp_llama.kernels.linear).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tp_llama.kernels import linear
from tp_llama.parallel.layout import ALL_GATHER, ALL_REDUCE, GATHER, NONE, tp_sharding

# torch 2.13 renamed all_gather_into_tensor; both take the concatenation along dim 0.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum the ranks' partial results, in place."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _on_host_under_gloo(collective):
    """Gloo gathers host tensors only: ranks sharing one GPU over gloo (checks/gpu_check.py) gather a copy."""

    def run(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        if x.is_cuda and dist.get_backend(group) == "gloo":
            return collective(x.cpu(), group).to(x.device)
        return collective(x, group)

    return run


@_on_host_under_gloo
def all_gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate the ranks' [..., n] pieces, in rank order, into [..., tp * n]."""
    tp = dist.get_world_size(group)
    x = x.contiguous()
    gathered = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x, group=group)
    return gathered.unflatten(0, (tp, x.shape[0])).movedim(0, -2).flatten(-2)


@_on_host_under_gloo
def gather_last_dim_to_rank0(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """On the group's rank 0, the ranks' [..., n] pieces side by side, [..., tp * n]; elsewhere [..., 0]."""
    x = x.contiguous()
    if dist.get_rank(group) != 0:
        dist.gather(x, None, group=group, group_dst=0)
        return x.new_empty((*x.shape[:-1], 0))
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.gather(x, pieces, group=group, group_dst=0)
    return torch.cat(pieces, dim=-1)


class LocalLinear(nn.Module):
    """A Linear on this rank's shard of the weight, then the collective its split needs (inference only).

    comm (layout.TP_TABLE): "none" (the output stays sharded on the features: column parallel, feeding local
    attention heads or FFN rows), "all_reduce" (row parallel: partial sums over the input
    features), "all_gather" (column parallel, whole features wanted on every rank) or "gather"
    (column parallel, whole features on rank 0 only: the logits).
    """

    lora = None  # LoRA adapters' delta (lora/slots.py's Projection), added before the collective, where held

    def __init__(self, weight: torch.Tensor, comm: str, group: dist.ProcessGroup | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.comm, self.group = comm, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight)
        return self.communicate(out if self.lora is None else self.lora.add(out, x))

    def communicate(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's product as the whole layer's output (all-reduced in place)."""
        if self.comm == ALL_REDUCE:
            return all_reduce_sum(out, self.group)
        if self.comm == ALL_GATHER:
            return all_gather_last_dim(out, self.group)
        if self.comm == GATHER:
            return gather_last_dim_to_rank0(out, self.group)
        return out

    def extra_repr(self) -> str:
        return f"local {tuple(self.weight.shape)}, {self.comm}"


class LocalEmbedding(nn.Module):
    """An Embedding on this rank's shard of the table, then the collective its split needs (inference only).

    comm "all_gather": the table is split on the embedding dim (Llama 1/2), every rank looks up
    every id and the [.., dim/tp] pieces are gathered. comm "all_reduce": the table is split on
    the vocabulary (Llama 3), rows [vocab_start, vocab_start + local rows); ids outside give
    zeros here and their row on the rank that holds it, and the sum is the lookup.
    """

    def __init__(self, weight: torch.Tensor, comm: str, group: dist.ProcessGroup | None, vocab_start: int = 0):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.comm, self.group, self.vocab_start = comm, group, vocab_start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm == ALL_REDUCE:
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.weight.shape[0])
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            return all_reduce_sum(out.masked_fill_(outside.unsqueeze(-1), 0), self.group)
        out = F.embedding(ids, self.weight)
        return all_gather_last_dim(out, self.group) if self.comm == ALL_GATHER else out

    def extra_repr(self) -> str:
        return f"local {tuple(self.weight.shape)}, {self.comm}, vocab_start={self.vocab_start}"


def local_module(name: str, weight: torch.Tensor, family: str, group: dist.ProcessGroup | None) -> nn.Module:
    """The tensor-parallel module `name` (Meta's name) on this rank's shard `weight` of its table.

    The shard dim and the collective come from layout.TP_TABLE. An embedding sharded on its
    vocabulary rows learns where its rows start from the rank (rank r holds rows r*n .. r*n+n-1).
    """
    rule = tp_sharding(name, family)
    if rule.dim is None or rule.comm not in (NONE, ALL_REDUCE, ALL_GATHER, GATHER):
        raise ValueError(f"{name}: TP_TABLE gives no sharded module ({rule})")
    if name.rpartition(".")[2] == "tok_embeddings":
        start = dist.get_rank(group) * weight.shape[0] if rule.dim == 0 else 0
        return LocalEmbedding(weight, rule.comm, group, start)
    return LocalLinear(weight, rule.comm, group)
