"""Layout rules: the full shape of every tensor, how fairscale split it, how we shard it.

One place decides all three so the loader, the local modules, the converter and the DTensor
test oracle agree: TP_TABLE gives each tensor's shard dim and its module's collective.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tp_llama.errors import CheckpointError
from tp_llama.model.args import ModelArgs

# Non-parameters some Meta files carry (Llama 2 writes the RoPE table as `rope.freqs`, the original
# LLaMA files one per layer as `layers.N.attention.inner_attention.rope.freqs`); every loader drops them.
IGNORED_KEYS = frozenset({"rope.freqs"})
# Llama 4's files add training statistics of its routers and Transformer Engine's extra state.
IGNORED_SUFFIXES = ("._extra_state", ".global_gate_stats_3E", ".expert_activation_DE")

# Collectives a tensor-parallel module runs on its output (see TP_TABLE). GATHER collects the
# pieces on rank 0 alone.
NONE, ALL_REDUCE, ALL_GATHER, GATHER = "none", "all_reduce", "all_gather", "gather"


@dataclass(frozen=True)
class Sharding:
    """How the `tp` mode holds one weight: its shard dim (None: a whole copy on every rank) and the
    collective its module runs on the output ("none": the output stays sharded on the features).
    """

    dim: int | None
    comm: str


# The one table of the `tp` mode, keyed by module (Meta's name without "layers.N." and ".weight").
# The shard dim is fairscale's split dim, so MP == TP loads are pure file slices. The collective
# follows from it: a Linear [out, in] sharded on dim 1 (or an embedding on its vocabulary rows)
# yields partial sums (all-reduce); one sharded on the output features yields a slice of them,
# kept inside a block (attention and the FFN work on local heads and rows), all-gathered at the
# embedding, where every rank needs whole activations, and gathered on rank 0 alone at the
# output: only rank 0 samples, so no other rank ever holds a [rows, vocab] tensor.
TP_TABLE: dict[str, Sharding | dict[str, Sharding]] = {
    "tok_embeddings": {"llama2": Sharding(1, ALL_GATHER), "llama3": Sharding(0, ALL_REDUCE),
                       "llama4": Sharding(0, ALL_REDUCE)},
    "attention.wq": Sharding(0, NONE),
    "attention.wk": Sharding(0, NONE),
    "attention.wv": Sharding(0, NONE),
    "attention.wo": Sharding(1, ALL_REDUCE),
    "feed_forward.w1": Sharding(0, NONE),
    "feed_forward.w3": Sharding(0, NONE),
    "feed_forward.w2": Sharding(1, ALL_REDUCE),
    "attention_norm": Sharding(None, NONE),
    "ffn_norm": Sharding(None, NONE),
    "norm": Sharding(None, NONE),
    "output": Sharding(0, GATHER),
    # Llama 4's MoE layers: the router whole on every rank, the shared expert and every routed expert
    # split on their width; their partial sums are added, then all-reduced once by the MoE itself.
    "feed_forward.router_DE": Sharding(None, NONE),
    "feed_forward.shared_expert.w1": Sharding(0, NONE),
    "feed_forward.shared_expert.w3": Sharding(0, NONE),
    "feed_forward.shared_expert.w2": Sharding(1, NONE),
    "feed_forward.experts.w1": Sharding(1, NONE),  # each expert a tensor of its own, in x @ W order
    "feed_forward.experts.w3": Sharding(1, NONE),
    "feed_forward.experts.w2": Sharding(0, NONE),
}
_LAYER = re.compile(r"layers\.\d+\.")
_EXPERT = re.compile(r"\.\d+$")  # Llama 4's routed experts: experts.w1.3 is expert 3's w1


_IGNORED_INSIDE = tuple("." + key for key in IGNORED_KEYS)  # the same entries inside a layer


def is_ignored(key: str) -> bool:
    """Whether a file's entry is a RoPE table (`rope.freqs`, at the top or inside a layer), never a parameter."""
    return key in IGNORED_KEYS or key.endswith(_IGNORED_INSIDE)


def tp_sharding(key: str, family: str) -> Sharding:
    """TP_TABLE's row for a parameter (`layers.3.attention.wo.weight`) or module (`layers.3.attention.wo`)."""
    module = _EXPERT.sub("", _LAYER.sub("", key, count=1).removesuffix(".weight"))
    if module not in TP_TABLE:
        raise KeyError(f"{key!r} is not a parameter of the Llama model")
    entry = TP_TABLE[module]
    return entry[family] if isinstance(entry, dict) else entry


def is_sharded(key: str) -> bool:
    """Whether fairscale split this parameter across its files (in either family)."""
    entry = TP_TABLE[_EXPERT.sub("", _LAYER.sub("", key, count=1).removesuffix(".weight"))]
    return any(rule.dim is not None for rule in (entry.values() if isinstance(entry, dict) else [entry]))


def full_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, in Meta's names and order, with its unsharded shape."""
    d, hd, f, v = args.dim, args.head_dim, args.ffn_dim, args.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (v, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention.wq.weight"] = (args.n_heads * hd, d)
        shapes[p + "attention.wk.weight"] = (args.n_kv_heads * hd, d)
        shapes[p + "attention.wv.weight"] = (args.n_kv_heads * hd, d)
        shapes[p + "attention.wo.weight"] = (d, args.n_heads * hd)
        if args.is_moe_layer(i):
            shapes.update(moe_shapes(args, p + "feed_forward."))
        else:
            shapes[p + "feed_forward.w1.weight"] = (f, d)
            shapes[p + "feed_forward.w2.weight"] = (d, f)
            shapes[p + "feed_forward.w3.weight"] = (f, d)
        shapes[p + "attention_norm.weight"] = (d,)
        shapes[p + "ffn_norm.weight"] = (d,)
    shapes["norm.weight"] = (d,)
    shapes["output.weight"] = (v, d)
    return shapes


def moe_shapes(args: ModelArgs, prefix: str) -> dict[str, tuple[int, ...]]:
    """A Llama 4 MoE layer's parameters (model/llama4.py) and their unsharded shapes."""
    d, e, f = args.dim, args.moe.experts, args.moe.expert_dim
    shapes = {prefix + "router_DE": (d, e), prefix + "shared_expert.w1.weight": (f, d),
              prefix + "shared_expert.w2.weight": (d, f), prefix + "shared_expert.w3.weight": (f, d)}
    for i in range(e):
        shapes |= {f"{prefix}experts.w1.{i}": (d, f), f"{prefix}experts.w3.{i}": (d, f), f"{prefix}experts.w2.{i}": (f, d)}
    return shapes


def shard_dim(key: str, family: str) -> int | None:
    """The dim fairscale split a tensor along (None: every file holds all of it); TP_TABLE's dim."""
    return tp_sharding(key, family).dim


def source_split_dim(
    key: str, full: tuple[int, ...], shard: tuple[int, ...], mp: int, path: object
) -> int | None:
    """Decide from shapes how a file holds its piece of a tensor (None: the whole tensor)."""
    if tuple(shard) == tuple(full):
        return None
    differing = [d for d in range(len(full)) if len(shard) == len(full) and shard[d] != full[d]]
    if len(differing) == 1 and shard[differing[0]] and full[differing[0]] % shard[differing[0]] == 0:
        parts = full[differing[0]] // shard[differing[0]]
        if parts != mp:
            raise CheckpointError(
                f"{path}: tensor {key!r} has shape {tuple(shard)}, 1/{parts} of the expected {tuple(full)}: "
                f"the checkpoint was split over {parts} files but {mp} consolidated.NN.pth file(s) were found"
            )
    if len(differing) != 1 or shard[differing[0]] * mp != full[differing[0]]:
        raise CheckpointError(
            f"{path}: tensor {key!r} has shape {tuple(shard)}, which is no exact split of the "
            f"expected {tuple(full)} over {mp} files"
        )
    return differing[0]


def check_tp_size(args: ModelArgs, tp: int) -> None:
    """Refuse a TP size that would cut a head (or a KV head, an FFN row, a vocab row) in two."""
    needs = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "ffn hidden size": args.ffn_dim,
        **({"experts' hidden size": args.moe.expert_dim} if args.moe else {}),
        "vocab_size": args.vocab_size,
        "dim": args.dim,
    }
    for name, value in needs.items():
        if value % tp:
            raise CheckpointError(
                f"tensor-parallel size {tp} does not divide {name} ({value}); "
                f"choose a TP size that divides n_heads={args.n_heads} and n_kv_heads={args.n_kv_heads}"
            )
