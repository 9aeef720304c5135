"""Layout rules: the full shape of every tensor, how fairscale split it, how we shard it.

One place decides all three so the loader, the converter and the parallel plan agree.
"""

from __future__ import annotations

from tp_llama.errors import CheckpointError
from tp_llama.params import ModelArgs

# Non-parameters some Meta files carry (Llama 2 writes the RoPE table); every loader drops them.
IGNORED_KEYS = frozenset({"rope.freqs"})

_COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
_ROW = ("attention.wo", "feed_forward.w2")


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
        shapes[p + "feed_forward.w1.weight"] = (f, d)
        shapes[p + "feed_forward.w2.weight"] = (d, f)
        shapes[p + "feed_forward.w3.weight"] = (f, d)
        shapes[p + "attention_norm.weight"] = (d,)
        shapes[p + "ffn_norm.weight"] = (d,)
    shapes["norm.weight"] = (d,)
    shapes["output.weight"] = (v, d)
    return shapes


def shard_dim(key: str, family: str) -> int | None:
    """The dim fairscale split a tensor along (None: every file holds all of it).

    Our tensor-parallel plan shards along the same dims, so MP == TP loads are pure file reads.
    """
    if key == "tok_embeddings.weight":
        return 0 if family == "llama3" else 1
    if key == "output.weight" or any(name in key for name in _COLUMN):
        return 0
    if any(name in key for name in _ROW):
        return 1
    return None


def source_split_dim(
    key: str, full: tuple[int, ...], shard: tuple[int, ...], mp: int, path: object
) -> int | None:
    """Decide from shapes how a file holds its piece of a tensor (None: the whole tensor)."""
    if tuple(shard) == tuple(full):
        return None
    differing = [d for d in range(len(full)) if len(shard) == len(full) and shard[d] != full[d]]
    if len(differing) == 1 and full[differing[0]] % shard[differing[0]] == 0:
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
        "vocab_size": args.vocab_size,
        "dim": args.dim,
    }
    for name, value in needs.items():
        if value % tp:
            raise CheckpointError(
                f"tensor-parallel size {tp} does not divide {name} ({value}); "
                f"choose a TP size that divides n_heads={args.n_heads} and n_kv_heads={args.n_kv_heads}"
            )
