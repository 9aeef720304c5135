"""LoRA adapters read from PEFT's or torchtune's files into Meta-layout factors, so that W_meta + B @ A is the
fine-tuned weight; what such a sum cannot express (DoRA, trained biases, embeddings, ...) is refused by name."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tp_llama.model.args import ModelArgs

MODULES = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
FORMATS = ("peft", "torchtune")

# Each layout's module names (under a layer) -> Meta's.
_HF_NAMES = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
             "mlp.gate_proj": "w1", "mlp.down_proj": "w2", "mlp.up_proj": "w3"}
_TUNE_NAMES = {"attn.q_proj": "wq", "attn.k_proj": "wk", "attn.v_proj": "wv", "attn.output_proj": "wo",
               "mlp.w1": "w1", "mlp.w2": "w2", "mlp.w3": "w3"}
_HF_LEAVES = tuple(name.split(".")[1] for name in _HF_NAMES)
_PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<module>\w+\.\w+)\.lora_(?P<part>[AB])\.weight")
_TUNE_KEY = re.compile(r"layers\.(?P<layer>\d+)\.(?P<module>\w+\.\w+)\.lora_(?P<part>[ab])\.weight")
# Tensors of what W + B @ A cannot express, by a pattern of their key, and the feature each belongs to.
_PEFT_REFUSED_KEYS = ((r"lora_magnitude_vector", "DoRA"), (r"lora_embedding_|embed_tokens", "LoRA on the embeddings"),
                      (r"lm_head", "LoRA on the output layer"), (r"modules_to_save", "modules_to_save"),
                      (r"\.bias$", "trained biases"))
_TUNE_REFUSED_KEYS = ((r"\.magnitude$", "DoRA"), (r"^tok_embeddings\.", "LoRA on the embeddings"),
                      (r"^output\.", "LoRA on the output layer"), (r"\.bias$", "trained biases"))
# adapter_config.json keys whose setting changes the model beyond W + B @ A, and the feature each turns on.
_PEFT_REFUSED_CONFIG = {
    "use_dora": "DoRA", "lora_bias": "trained biases (lora_bias)",
    "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
    "trainable_token_indices": "trainable embedding tokens", "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA (aLoRA)", "use_qalora": "QA-LoRA",
    "target_parameters": "LoRA on parameters (target_parameters)", "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing", "kasa_config": "KaSA", "monteclora_config": "MonteCLoRA",
}
# init_lora_weights that also change the base weight (W - B0 @ A0, or LoftQ's quantized W): the adapter fits
# only that changed base, until PEFT converts it to plain LoRA (path_initial_model_for_weight_conversion).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
_SUPPORTED = "only plain LoRA, whose B @ A adds to a weight, is served"

# (layer, Meta module) -> (A, B, the module's name in the file), as read, before any checks.
Factors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, str]]


class AdapterError(ValueError):
    """An adapter cannot be served; the message names the feature, the file and the module at fault."""


@dataclass(frozen=True)
class Adapter:
    name: str
    source: str  # the file the weights came from
    rank: int  # the largest of its modules' ranks
    # (layer, Meta module) -> (A [r, in] float32, B [out, r] float32), B times the module's scale and its wq / wk
    # rows in Meta's rotary order: W_meta + B @ A is the fine-tuned weight.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str  # sha256 of the weights alone: equal weights, equal digest, whatever the name or folder


def read_adapter(name: str, entry: str | Path | dict, args: ModelArgs, max_rank: int) -> Adapter:
    """The yaml entry's adapter, B scaled and its q/k rows in Meta's rotary order; AdapterError if it cannot be
    served on this base as a sum W + B @ A."""
    try:
        folder, lora_alpha, fmt = _parse_entry(entry)
        fmt = fmt or _detect(folder)
        if fmt == "peft":
            path, factors, scale = _read_peft(folder, lora_alpha)
        else:
            path, factors, scale = _read_torchtune(folder, lora_alpha)
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, module), (a, b, label) in sorted(factors.items()):
            rank = _check_shapes(a, b, layer, module, f"{label} ({module})", args, max_rank, path)
            b = b.float() * scale(label, rank)
            if fmt == "peft" and module in ("wq", "wk"):
                b = _from_hf_rotary(b, args.n_heads if module == "wq" else args.n_kv_heads)
            weights[(layer, module)] = (a.float().contiguous(), b.contiguous())
    except AdapterError as exc:
        raise AdapterError(f"LoRA adapter {name!r}: {exc}") from None
    rank = max(a.shape[0] for a, _ in weights.values())
    return Adapter(name, str(path), rank, weights, _digest(weights))


def _parse_entry(entry: object) -> tuple[Path, float | None, str | None]:
    """The yaml value: a folder, or {path, lora_alpha, format}."""
    if isinstance(entry, (str, Path)):
        return Path(entry), None, None
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), (str, Path)):
        raise AdapterError(f"expected a folder or a mapping with a 'path' (and 'lora_alpha', 'format'), got {entry!r}")
    unknown = sorted(set(entry) - {"path", "lora_alpha", "format"})
    if unknown:
        raise AdapterError(f"unknown keys {unknown} in the yaml entry; expected path, lora_alpha, format")
    fmt, alpha = entry.get("format"), entry.get("lora_alpha")
    if fmt is not None and fmt not in FORMATS:
        raise AdapterError(f"format {fmt!r} in the yaml entry; expected one of {', '.join(FORMATS)}")
    if alpha is not None and not _is_number(alpha):
        raise AdapterError(f"lora_alpha {alpha!r} in the yaml entry is not a number")
    return Path(entry["path"]), alpha, fmt


def _is_number(value: object) -> bool:
    # bool is an int to Python, but true for lora_alpha is a typo, not 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _detect(folder: Path) -> str:
    if not folder.is_dir():
        raise AdapterError(f"{folder}: not a folder")
    if (folder / "adapter_config.json").is_file():
        return "peft"
    if _torchtune_file(folder) is not None:
        return "torchtune"
    raise AdapterError(f"{folder}: no adapter found: looked for adapter_config.json with adapter_model.safetensors "
                       "or adapter_model.bin (PEFT), adapter_model.pt or adapter_*.pt (torchtune)")


def _torchtune_file(folder: Path) -> Path | None:
    """adapter_model.pt, else the one adapter_N.pt (older torchtune names its adapter by epoch)."""
    if (folder / "adapter_model.pt").is_file():
        return folder / "adapter_model.pt"
    numbered = sorted(folder.glob("adapter_*.pt"))
    if len(numbered) > 1:
        raise AdapterError(f"{folder}: several torchtune adapters ({', '.join(p.name for p in numbered)}) and no "
                           "adapter_model.pt: point the entry at a folder holding one")
    return numbered[0] if numbered else None


def _read_peft(folder: Path, lora_alpha: float | None) -> tuple[Path, Factors, Callable[[str, int], float]]:
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise AdapterError(f"{folder}: no PEFT adapter: looked for adapter_config.json")
    if lora_alpha is not None:
        raise AdapterError(f"{config_path}: lora_alpha in the yaml entry is for torchtune's files; PEFT's config "
                           "sets it, so drop it from the entry")
    config = _load_json(config_path)
    _check_peft_config(config, config_path)
    weights_path = next((folder / n for n in ("adapter_model.safetensors", "adapter_model.bin")
                         if (folder / n).is_file()), None)
    if weights_path is None:
        raise AdapterError(f"{folder}: adapter_config.json but no weights: looked for adapter_model.safetensors "
                           "and adapter_model.bin")
    factors = _collect(_load_tensors(weights_path), weights_path, _PEFT_KEY, _HF_NAMES, _PEFT_REFUSED_KEYS)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}

    def scale(label: str, rank: int) -> float:
        r = _by_pattern(rank_pattern, label, config["r"])
        alpha = _by_pattern(alpha_pattern, label, config["lora_alpha"])
        if r != rank:
            raise AdapterError(f"{weights_path}: {label} has rank {rank}, but {config_path.name} gives it rank {r}: "
                               "the files disagree")
        return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r

    return weights_path, factors, scale


def _check_peft_config(config: dict, path: Path) -> None:
    """Refuse the features and target modules that a sum W + B @ A cannot serve, before any tensor is read."""
    targets = config.get("target_modules")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: a {config['peft_type']} adapter (target modules {targets}): {_SUPPORTED}")
    for key, feature in _PEFT_REFUSED_CONFIG.items():
        if config.get(key):
            raise AdapterError(f"{path}: {feature} is not supported ({key} {config[key]!r}; target modules "
                               f"{targets}): {_SUPPORTED}")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise AdapterError(f"{path}: init_lora_weights {init!r} changed the base weights before training, so the "
                           "adapter fits only that changed base: save it with PEFT's save_pretrained("
                           "path_initial_model_for_weight_conversion=...) to serve it as plain LoRA on the original")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: trained biases are not supported (bias {config['bias']!r}; target modules "
                           f"{targets}): {_SUPPORTED}")
    if isinstance(targets, list):
        for target in targets:
            leaf = str(target).rsplit(".", 1)[-1]
            if leaf in ("embed_tokens", "lm_head"):
                raise AdapterError(f"{path}: LoRA on the embeddings or the output layer is not supported (target "
                                   f"module {target!r}): {_SUPPORTED}")
            if leaf not in _HF_LEAVES:
                raise AdapterError(f"{path}: unknown target module {target!r}; expected {', '.join(_HF_LEAVES)}")
    elif not isinstance(targets, str):  # "all-linear" or a regex: the tensors' keys say which modules it took
        raise AdapterError(f"{path}: target_modules {targets!r} is neither a list nor a string")
    if not (isinstance(config.get("r"), int) and config["r"] > 0 and _is_number(config.get("lora_alpha"))):
        raise AdapterError(f"{path}: r must be a positive integer and lora_alpha a number, got r {config.get('r')!r}, "
                           f"lora_alpha {config.get('lora_alpha')!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise AdapterError(f"{path}: {key} must map module names to values, got {config[key]!r}")


def _by_pattern(patterns: dict, label: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern rule: the first key that, as a regex, matches the module's name or
    a dotted tail of it."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({pattern})", label):
            return value
    return default


def _read_torchtune(folder: Path, lora_alpha: float | None) -> tuple[Path, Factors, Callable[[str, int], float]]:
    path = _torchtune_file(folder) if folder.is_dir() else None
    if path is None:
        raise AdapterError(f"{folder}: no torchtune adapter: looked for adapter_model.pt and adapter_*.pt")
    if lora_alpha is None:
        raise AdapterError(f"{path}: torchtune's Meta-format checkpointer writes no config, so its alpha is unknown: "
                           "set lora_alpha in this adapter's yaml entry (the recipe's model.lora_alpha)")
    factors = _collect(_load_tensors(path), path, _TUNE_KEY, _TUNE_NAMES, _TUNE_REFUSED_KEYS)
    return path, factors, lambda label, rank: lora_alpha / rank


def _load_json(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    return config


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file  # only PEFT's files need it

            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # each parser fails its own way on a corrupt file; all mean the same here
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise AdapterError(f"{path}: unreadable or corrupt ({type(exc).__name__}: {reason})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise AdapterError(f"{path}: expected a mapping of tensor names to tensors")
    if not state:
        raise AdapterError(f"{path}: holds no tensors")
    return state


def _collect(state: dict[str, torch.Tensor], path: Path, key_re: re.Pattern, names: dict[str, str],
             refused: tuple[tuple[str, str], ...]) -> Factors:
    """Pair each module's A and B by their keys, refusing any tensor that is not a known module's factor."""
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    labels: dict[tuple[int, str], str] = {}
    for key, tensor in state.items():
        for pattern, feature in refused:
            if re.search(pattern, key):
                raise AdapterError(f"{path}: {feature} is not supported (tensor {key}): {_SUPPORTED}")
        match = key_re.fullmatch(key)
        module = names.get(match["module"]) if match else None
        if module is None:
            raise AdapterError(f"{path}: tensor {key} is not a LoRA factor of a known module; expected "
                               f"layers.N.<{'|'.join(names)}>.lora_A/B.weight")
        slot = (int(match["layer"]), module)
        part = match["part"].upper()
        if part in parts.setdefault(slot, {}):
            raise AdapterError(f"{path}: two lora_{part} tensors for layer {slot[0]} {module} (tensor {key})")
        parts[slot][part] = tensor
        # PEFT's patterns match the module's name in the model it wrapped, without its own prefix.
        labels[slot] = key.rsplit(".lora_", 1)[0].removeprefix("base_model.model.")
    for slot, pair in parts.items():
        if len(pair) != 2:
            missing = "B" if "A" in pair else "A"
            raise AdapterError(f"{path}: {labels[slot]} has no lora_{missing} tensor")
    return {slot: (pair["A"], pair["B"], labels[slot]) for slot, pair in parts.items()}


def _check_shapes(a: torch.Tensor, b: torch.Tensor, layer: int, module: str, label: str, args: ModelArgs,
                  max_rank: int, path: Path) -> int:
    """The module's rank, once A [r, in] and B [out, r] fit the base's module and r fits the slots."""
    if layer >= args.n_layers:
        raise AdapterError(f"{path}: {label} is in layer {layer}, but the base model has {args.n_layers} layers: "
                           "an adapter for another base")
    if a.dim() != 2 or b.dim() != 2 or not (a.is_floating_point() and b.is_floating_point()):
        raise AdapterError(f"{path}: {label}: lora_A and lora_B must be 2-d float tensors, got {a.dtype} "
                           f"{tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    rank = a.shape[0]
    if b.shape[1] != rank or rank == 0:
        raise AdapterError(f"{path}: {label}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} disagree on the rank")
    out_features, in_features = _module_shape(args, module)
    if (b.shape[0], a.shape[1]) != (out_features, in_features):
        raise AdapterError(f"{path}: {label}: lora_B @ lora_A is {b.shape[0]} x {a.shape[1]}, but the base model's "
                           f"{module} is {out_features} x {in_features}: an adapter for another base")
    if rank > max_rank:
        raise AdapterError(f"{path}: {label} has rank {rank}, above the slots' {max_rank}: raise "
                           f"handler.max_lora_rank to at least {rank}")
    return rank


def _module_shape(args: ModelArgs, module: str) -> tuple[int, int]:
    """(out_features, in_features) of a Meta projection."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {"wq": (q, args.dim), "wk": (kv, args.dim), "wv": (kv, args.dim), "wo": (args.dim, q),
            "w1": (args.ffn_dim, args.dim), "w3": (args.ffn_dim, args.dim), "w2": (args.dim, args.ffn_dim)}[module]


def _from_hf_rotary(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face orders each head's rows [2, head_dim/2] (halves rotated together), Meta [head_dim/2, 2]
    (adjacent pairs): B's rows must follow wq / wk as Meta lays them out."""
    out, rank = rows.shape
    return rows.reshape(n_heads, 2, out // n_heads // 2, rank).transpose(1, 2).reshape(out, rank)


def _digest(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> str:
    """sha256 over the folded tensors alone, so one adapter under two names or in two folders is one."""
    digest = hashlib.sha256()
    for (layer, module), pair in sorted(weights.items()):
        for tensor in pair:
            digest.update(f"{layer}.{module}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()
