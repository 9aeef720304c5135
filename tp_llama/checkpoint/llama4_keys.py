"""Llama 4's download under the model's names: which part of which file tensor each parameter is.

Meta's Llama 4 files keep the names of its training code: q/k/v fused per shard (`attention.wqkv`), a
dense FFN's w1 and w3 stacked per shard (`feed_forward.mlp.fc1_weight`), the norms under the layers they
feed, the shared expert as `w_*_shared_*`, and the routed experts flattened to 2-D in x @ W order, every
shard holding all experts with a slice of their width (llama-models 0.3.0's load hooks undo this at
load). Here each model parameter names its file tensor and, per file, a block of its rows (each expert is
a parameter of its own: its block of the flattened rows, so a load can prepare and drop one expert at a
time); a block of rows is a view of the memory-mapped file, so the reader (checkpoint/reader.py) still
reads each rank's slices alone, from any MP onto any TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tp_llama.checkpoint.shards import check_keys
from tp_llama.errors import CheckpointError
from tp_llama.model.args import ModelArgs

# The vision encoder's tensors: served text-only, so never read.
VISION_PREFIXES = ("vision_embeddings.", "vision_projection.")


@dataclass(frozen=True)
class Source:
    """A parameter's tensor in the files: `key`, and rows [start/parts, end/parts) of each file's tensor (rows)."""

    key: str
    rows: tuple[int, int, int] | None = None


def sources(args: ModelArgs) -> dict[str, Source]:
    """Every model parameter (model/llama4.py's names) and where the download holds it."""
    heads, kv = args.n_heads, args.n_kv_heads
    qkv = heads + 2 * kv
    out = {name: Source(name) for name in ("tok_embeddings.weight", "norm.weight", "output.weight")}
    for i in range(args.n_layers):
        p, ffn = f"layers.{i}.", f"layers.{i}.feed_forward."
        wqkv = p + "attention.wqkv.weight"
        out[p + "attention.wq.weight"] = Source(wqkv, (0, heads, qkv))
        out[p + "attention.wk.weight"] = Source(wqkv, (heads, heads + kv, qkv))
        out[p + "attention.wv.weight"] = Source(wqkv, (heads + kv, qkv, qkv))
        out[p + "attention.wo.weight"] = Source(p + "attention.wo.weight")
        out[p + "attention_norm.weight"] = Source(p + "attention.wqkv.layer_norm_weight")
        if args.is_moe_layer(i):
            e = args.moe.experts
            out[p + "ffn_norm.weight"] = Source(ffn + "norm.weight")
            out[ffn + "router_DE"] = Source(ffn + "router_DE")
            out[ffn + "shared_expert.w1.weight"] = Source(ffn + "w_in_shared_FD.weight")
            out[ffn + "shared_expert.w3.weight"] = Source(ffn + "w_swiglu_FD.weight")
            out[ffn + "shared_expert.w2.weight"] = Source(ffn + "w_out_shared_DF.weight")
            for x in range(e):  # expert x: its block of each file's rows
                out[f"{ffn}experts.w1.{x}"] = Source(ffn + "experts.moe_w_in_eD_F", (x, x + 1, e))
                out[f"{ffn}experts.w3.{x}"] = Source(ffn + "experts.moe_w_swiglu_eD_F", (x, x + 1, e))
                out[f"{ffn}experts.w2.{x}"] = Source(ffn + "experts.moe_w_out_eF_D", (x, x + 1, e))
        else:
            out[p + "ffn_norm.weight"] = Source(ffn + "mlp.layer_norm_weight")
            out[ffn + "w1.weight"] = Source(ffn + "mlp.fc1_weight", (0, 1, 2))
            out[ffn + "w3.weight"] = Source(ffn + "mlp.fc1_weight", (1, 2, 2))
            out[ffn + "w2.weight"] = Source(ffn + "mlp.fc2_weight")
    return out


def _part(tensor: torch.Tensor, source: Source, path: Path) -> torch.Tensor:
    """The parameter's part of one file's tensor, as a view of it."""
    if source.rows is not None:
        start, end, parts = source.rows
        rows = tensor.shape[0]
        if rows % parts:
            raise CheckpointError(f"{path}: tensor {source.key!r} has {rows} rows, which do not split into its "
                                  f"{parts} stacked parts")
        return tensor[rows * start // parts : rows * end // parts]
    return tensor


class Llama4Files:
    """Turns one file's tensors (download names) into the model's parameters, as views; counts the vision
    tensors it skips."""

    def __init__(self, args: ModelArgs):
        self.sources = sources(args)
        self.file_keys = {source.key: () for source in self.sources.values()}
        self.vision_skipped = 0

    def __call__(self, state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
        vision = [key for key in state if key.startswith(VISION_PREFIXES)]
        self.vision_skipped = len(vision)
        text = {key: tensor for key, tensor in state.items() if not key.startswith(VISION_PREFIXES)}
        check_keys(text, self.file_keys, path)
        return {name: _part(text[source.key], source, path) for name, source in self.sources.items()}
