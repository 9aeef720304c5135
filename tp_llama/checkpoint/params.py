"""Reading Meta's params.json into ModelArgs, every key checked."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tp_llama.errors import CheckpointError
from tp_llama.checkpoint.params_llama4 import llama4_fields
from tp_llama.llama4_format import is_llama4_params
from tp_llama.model.args import ModelArgs, ffn_hidden_dim

if TYPE_CHECKING:
    from tp_llama.tokenizer import Tokenizer

_REQUIRED = {"dim": int, "n_layers": int, "n_heads": int, "norm_eps": (int, float)}
_OPTIONAL = {
    "n_kv_heads": (int, type(None)),
    "vocab_size": int,
    "multiple_of": int,
    "ffn_dim_multiplier": (int, float, type(None)),
    "rope_theta": (int, float),
    "use_scaled_rope": bool,
}


def _check_type(path: Path, key: str, value: object, kind: type | tuple[type, ...]) -> None:
    # bool is an int subclass; a true/false where a number belongs is a broken file.
    is_bool_misuse = isinstance(value, bool) and kind is not bool
    if is_bool_misuse or not isinstance(value, kind):
        raise CheckpointError(f"{path}: key {key!r} has invalid value {value!r}")


def parse_params(raw: dict, path: Path, tokenizer_vocab: int | None = None) -> ModelArgs:
    """Validate a params.json mapping (flat or nested under "model") into ModelArgs."""
    if isinstance(raw.get("model"), dict):
        raw = raw["model"]
    for key, kind in _REQUIRED.items():
        if key not in raw:
            raise CheckpointError(f"{path}: missing required key {key!r}")
        _check_type(path, key, raw[key], kind)
    for key, kind in _OPTIONAL.items():
        if key in raw:
            _check_type(path, key, raw[key], kind)

    dim, n_heads = raw["dim"], raw["n_heads"]
    n_kv_heads = raw.get("n_kv_heads") or n_heads
    positive = {"dim": dim, "n_layers": raw["n_layers"], "n_heads": n_heads, "n_kv_heads": n_kv_heads}
    for key, value in positive.items():
        if value <= 0:
            raise CheckpointError(f"{path}: key {key!r} must be positive, got {value}")
    if dim % n_heads:
        raise CheckpointError(f"{path}: dim {dim} is not divisible by n_heads {n_heads}")
    if n_heads % n_kv_heads:
        raise CheckpointError(f"{path}: n_heads {n_heads} is not divisible by n_kv_heads {n_kv_heads}")
    if (dim // n_heads) % 2:
        raise CheckpointError(f"{path}: head dim {dim // n_heads} must be even for rotary embeddings")
    if not raw["norm_eps"] > 0:
        raise CheckpointError(f"{path}: key 'norm_eps' must be positive, got {raw['norm_eps']}")
    multiple_of = raw.get("multiple_of", 256)
    if multiple_of <= 0:
        raise CheckpointError(f"{path}: key 'multiple_of' must be positive, got {multiple_of}")

    vocab_size = raw.get("vocab_size", -1)
    family = "llama4" if is_llama4_params(raw) else "llama3" if vocab_size > 0 else "llama2"
    llama4 = llama4_fields(raw, path) if family == "llama4" else {}
    if vocab_size <= 0:
        if tokenizer_vocab is None:
            raise CheckpointError(f"{path}: vocab_size is {vocab_size} and no tokenizer was given to take it from")
        vocab_size = tokenizer_vocab
    rope_theta = float(raw.get("rope_theta", 10000.0))
    if not rope_theta > 0:
        raise CheckpointError(f"{path}: key 'rope_theta' must be positive, got {rope_theta}")
    return ModelArgs(
        dim=dim,
        n_layers=raw["n_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        ffn_dim=ffn_hidden_dim(dim, multiple_of, raw.get("ffn_dim_multiplier")),
        norm_eps=float(raw["norm_eps"]),
        rope_theta=rope_theta,
        use_scaled_rope=raw.get("use_scaled_rope", False),
        family=family,
        **llama4,
    )


def read_params(ckpt_dir: str | os.PathLike, tokenizer_vocab: int | None = None) -> ModelArgs:
    path = Path(ckpt_dir) / "params.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return parse_params(raw, path, tokenizer_vocab)


def check_tokenizer_fits(tokenizer: Tokenizer, args: ModelArgs, ckpt_dir: str | os.PathLike) -> None:
    """Every id the tokenizer makes must have a row in the embedding and the output layer (both
    vocab_size rows, checked against params.json when the shards are read), or the first request
    that meets one kills the worker. Fewer ids than rows is fine: Meta pads some embeddings."""
    if tokenizer.n_words <= args.vocab_size:
        return
    folder, v, n = Path(ckpt_dir), args.vocab_size, tokenizer.n_words
    specials = sorted((i, name) for i, name in tokenizer.special_names().items() if i >= v)
    named = ", ".join(f"{name} ({i:,})" for i, name in specials[:4]) + (", ..." if len(specials) > 4 else "")
    outside = f"{len(specials)} of its special ids among them: {named}" if specials else "none of them special"
    raise CheckpointError(
        f"{folder / 'tokenizer.model'}: the tokenizer makes {n:,} ids ({tokenizer.family} format) but "
        f"{folder / 'params.json'} has vocab_size {v:,}, the rows of tok_embeddings and output: ids {v:,} to "
        f"{n - 1:,} have no row ({outside}). Serve it with a tokenizer.model whose ids fit in {v:,}, or give "
        f"the model a row for every id: tok_embeddings.weight and output.weight padded to {n:,} rows and "
        f"vocab_size {n:,} in params.json")
