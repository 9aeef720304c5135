"""Reading Meta's params.json into ModelArgs, every key checked.

A Llama 4 params.json (the one with moe_args) has every key known or refused with its name: a key this
reader does not know may change the math (llama-models 0.3.0's `llama4/args.py` lists them all), and a
Llama 4 served with one ignored would answer wrongly rather than fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tp_llama.errors import CheckpointError
from tp_llama.llama4_format import is_llama4_params
from tp_llama.model.args import ModelArgs, MoEArgs, expert_hidden_dim, ffn_hidden_dim

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


# params.json keys of llama-models' Llama 4 ModelArgs; max_batch_size / max_seq_len size Meta's own
# cache only, head_dim is dim // n_heads in Meta's attention whatever it says.
KNOWN = frozenset({
    "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "multiple_of", "ffn_dim_multiplier",
    "ffn_exp", "norm_eps", "attention_chunk_size", "rope_theta", "use_scaled_rope", "rope_scaling_factor",
    "rope_high_freq_factor", "nope_layer_interval", "use_qk_norm", "attn_temperature_tuning", "floor_scale",
    "attn_scale", "vision_args", "moe_args", "quantization_args", "lora_args", "max_batch_size", "max_seq_len",
})
MOE_KNOWN = frozenset({"num_experts", "capacity_factor", "auto_scale_F", "top_k", "interleave_moe_layer_step"})
# (dim, n_layers, n_heads, n_kv_heads) of Llama 3.2 1B and 3B, whose scaled RoPE stretches by 32, not Llama 3.1's
# 8: their Hugging Face configs say so and Meta confirmed it (meta-llama/llama-models#166, #241); Meta's
# params.json names no factor, and llama-models' reference code uses 8 for every Llama 3.
LLAMA32_SMALL = frozenset({(2048, 16, 32, 8), (3072, 28, 24, 8)})
NUMBER = (int, float)


def _get(raw: dict, key: str, kind: type | tuple[type, ...], default: object, path: Path, where: str = "") -> object:
    """raw[key] (or `default`) checked to be a `kind`; None stays None where the default is None."""
    value = raw.get(key, default)
    if value is None and default is None:
        return None
    _check_type(path, where + key, value, kind)
    return value


def _positive(value: float | None, key: str, path: Path) -> None:
    if value is not None and not value > 0:
        raise CheckpointError(f"{path}: key {key!r} must be positive, got {value}")


def moe_args(raw: dict, dim: int, multiple_of: int, path: Path) -> MoEArgs:
    """moe_args, checked: top-1 routing only (what Meta ships and its code computes)."""
    moe = raw["moe_args"]
    if not isinstance(moe, dict):
        raise CheckpointError(f"{path}: key 'moe_args' must be an object, got {moe!r}")
    unknown = sorted(set(moe) - MOE_KNOWN)
    if unknown:
        raise CheckpointError(f"{path}: unknown key 'moe_args.{unknown[0]}' (known: {', '.join(sorted(MOE_KNOWN))})")
    experts = _get(moe, "num_experts", int, -1, path, "moe_args.")
    top_k = _get(moe, "top_k", int, 1, path, "moe_args.")
    step = _get(moe, "interleave_moe_layer_step", int, 1, path, "moe_args.")
    capacity = _get(moe, "capacity_factor", NUMBER, 1.0, path, "moe_args.")
    auto_scale = _get(moe, "auto_scale_F", bool, True, path, "moe_args.")
    for key, value in (("num_experts", experts), ("interleave_moe_layer_step", step), ("capacity_factor", capacity)):
        _positive(value, f"moe_args.{key}", path)
    if top_k != 1:
        raise CheckpointError(f"{path}: key 'moe_args.top_k' is {top_k}; only top-1 routing (Llama 4's) is served")
    ffn_exp = _get(raw, "ffn_exp", NUMBER, None, path)
    multiplier = _get(raw, "ffn_dim_multiplier", NUMBER, None, path)
    if ffn_exp is None or multiplier is None:
        missing = "ffn_exp" if ffn_exp is None else "ffn_dim_multiplier"
        raise CheckpointError(f"{path}: key {missing!r} is required with moe_args (it sets the experts' width)")
    _positive(ffn_exp, "ffn_exp", path)
    width = expert_hidden_dim(dim, ffn_exp, multiplier, multiple_of, capacity, auto_scale)
    _positive(width, "ffn_exp", path)
    return MoEArgs(experts=experts, expert_dim=width, interleave=step)


def llama4_fields(raw: dict, path: Path) -> dict:
    """ModelArgs' Llama 4 fields from a params.json that has moe_args (Llama 3's keys read by the caller)."""
    unknown = sorted(set(raw) - KNOWN)
    if unknown:
        raise CheckpointError(f"{path}: unknown key {unknown[0]!r} in a Llama 4 params.json (llama-models 0.3.0 "
                              "knows no such key; refusing rather than serving a model computed without it)")
    quantization = raw.get("quantization_args")
    if quantization and (not isinstance(quantization, dict) or quantization.get("scheme")):
        raise CheckpointError(f"{path}: this Llama 4 download is quantized (quantization_args {quantization!r}); "
                              "Llama 4's quantized formats are not served yet: use its bfloat16 download, with "
                              "handler.quantize to quantize it at load")
    if raw.get("lora_args"):
        raise CheckpointError(f"{path}: key 'lora_args' is set; a Llama 4 checkpoint with built-in LoRA is not served")
    chunk = _get(raw, "attention_chunk_size", int, None, path)
    interval = _get(raw, "nope_layer_interval", int, None, path)
    floor_scale = _get(raw, "floor_scale", NUMBER, 8192.0, path)
    for key, value in (("attention_chunk_size", chunk), ("nope_layer_interval", interval), ("floor_scale", floor_scale)):
        _positive(value, key, path)
    scaling = rope_scaling(raw, path, 16, 1)  # llama-models fills in Scout's own where params.json names none
    fields = {
        "moe": moe_args(raw, raw["dim"], raw.get("multiple_of", 256), path),
        "nope_layer_interval": interval,
        "use_qk_norm": _get(raw, "use_qk_norm", bool, False, path),
        "attention_chunk_size": chunk,
        "attn_temperature_tuning": _get(raw, "attn_temperature_tuning", bool, False, path),
        "floor_scale": float(floor_scale),
        "attn_scale": float(_get(raw, "attn_scale", NUMBER, 0.1, path)),
    }
    if _get(raw, "use_scaled_rope", bool, False, path):
        fields["rope_scaling"] = scaling
    return fields


def rope_scaling(raw: dict, path: Path, factor: float, high: float) -> tuple[float, float]:
    """Scaled RoPE's (factor, high-frequency factor): params.json's rope_scaling_factor and
    rope_high_freq_factor where it names them, else the family's own."""
    named_factor = _get(raw, "rope_scaling_factor", NUMBER, None, path)
    named_high = _get(raw, "rope_high_freq_factor", NUMBER, None, path)
    return (float(factor if named_factor is None else named_factor), float(high if named_high is None else named_high))


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
    n_kv_heads = n_heads if raw.get("n_kv_heads") is None else raw["n_kv_heads"]
    positive = {"dim": dim, "n_layers": raw["n_layers"], "n_heads": n_heads, "n_kv_heads": n_kv_heads}
    for key, value in positive.items():
        _positive(value, key, path)
    if dim % n_heads:
        raise CheckpointError(f"{path}: dim {dim} is not divisible by n_heads {n_heads}")
    if n_heads % n_kv_heads:
        raise CheckpointError(f"{path}: n_heads {n_heads} is not divisible by n_kv_heads {n_kv_heads}")
    if (dim // n_heads) % 2:
        raise CheckpointError(f"{path}: head dim {dim // n_heads} must be even for rotary embeddings")
    _positive(raw["norm_eps"], "norm_eps", path)
    multiple_of = raw.get("multiple_of", 256)
    _positive(multiple_of, "multiple_of", path)

    vocab_size = raw.get("vocab_size", -1)
    family = "llama4" if is_llama4_params(raw) else "llama3" if vocab_size > 0 else "llama2"
    extra = llama4_fields(raw, path) if family == "llama4" else {}
    if family == "llama3" and raw.get("use_scaled_rope"):
        small = (dim, raw["n_layers"], n_heads, n_kv_heads) in LLAMA32_SMALL
        extra["rope_scaling"] = rope_scaling(raw, path, 32 if small else 8, 4)
    if vocab_size <= 0:
        if tokenizer_vocab is None:
            raise CheckpointError(f"{path}: vocab_size is {vocab_size} and no tokenizer was given to take it from")
        vocab_size = tokenizer_vocab
    # llama-models' Llama 4 ModelArgs default (Llama 2's files leave it out meaning 10,000)
    rope_theta = float(raw.get("rope_theta", 500000.0 if family == "llama4" else 10000.0))
    _positive(rope_theta, "rope_theta", path)
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
        **extra,
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
