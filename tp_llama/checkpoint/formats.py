"""Which of Meta's checkpoint formats a folder holds, told from the checkpoint itself, and the tensors
each format adds to the consolidated files.

- 16-bit (bf16): the plain layout.
- int4 (Llama 3.2 1B/3B Instruct QLoRA and SpinQuant): params.json has `quantization_args` (a
  `group_size`; a `scheme`, where given, must be torchao's int4-weight int8-dynamic-activation one),
  QLoRA also `lora_args` (`rank`, `scale`). Every linear of the layers holds `weight` (int8, values
  -8..7), `scales` ([out, k / group_size]) and, where saved, `zeros` alike; QLoRA adds
  `adaptor.A.weight` [rank, k] and `adaptor.B.weight` [out, rank]. `tok_embeddings` and `output`
  hold int8 `weight` and `scales` (one or more a row). SpinQuant's w2 takes a Hadamard transform of its
  input: where `quantization_args.spinquant` says so, or, without that key, where there is no LoRA
  (llama-models' own list of Meta's int4 downloads gives SpinQuant no other mark).
- fp8 (Llama 3.1 405B): `fp8_scales_N.pt` beside each `consolidated.NN.pth`, a dict of float32
  scales, one per row of that file's shard of each float8 weight, keyed `{layer}_feed_forward.{w}_{N}`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tp_llama.errors import CheckpointError
from tp_llama.model.args import ModelArgs

INT4_SCHEME = "int4_weight_int8_dynamic_activation"
LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")
INT8_TABLES = ("tok_embeddings", "output")  # int8 with scales: dequantized at load, as Meta's loader does
ADAPTOR_NAMES = (("A", "B"), ("0", "1"))  # nn.Sequential's names of the adaptor's two Linears
FP8_SCALE_FILE = re.compile(r"fp8_scales_(\d+)\.pt")
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class CheckpointFormat:
    """What the checkpoint holds: kind "bf16" (16-bit weights), "int4" or "fp8", and that format's settings."""

    kind: str = "bf16"
    group: int = 0
    lora_rank: int = 0
    lora_scale: float = 0.0
    hadamard: bool = False
    hadamard_why: str = ""
    fp8_scales: tuple[Path, ...] = ()

    @property
    def quantized(self) -> bool:
        return self.kind != "bf16"

    def describe(self) -> str:
        """One line for the load log."""
        if self.kind == "int4":
            lora = f", LoRA rank {self.lora_rank} scale {self.lora_scale:g}" if self.lora_rank else ", no LoRA"
            spin = f", Hadamard on w2's input ({self.hadamard_why})" if self.hadamard else ""
            return (f"Meta int4 checkpoint (QLoRA / SpinQuant): int4 weights in groups of {self.group} along k, "
                    f"int8 activations per token{lora}{spin}; embedding and output int8 with scales")
        if self.kind == "fp8":
            return (f"Meta fp8 checkpoint: float8 feed-forward weights with row scales from "
                    f"{', '.join(p.name for p in self.fp8_scales)}")
        return "16-bit checkpoint"


def _raw_params(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return raw


def _entry(raw: dict, key: str) -> object:
    nested = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    return raw.get(key, nested.get(key))


def _number(path: Path, key: str, value: object, kind: type, positive: bool = True) -> int | float:
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok or (positive and value <= 0):
        raise CheckpointError(f"{path}: {key} must be a positive {'number' if kind is float else 'integer'}, "
                              f"got {value!r}")
    return value


def read_format(ckpt_dir: str | Path, mp: int) -> CheckpointFormat:
    """The format of the checkpoint in `ckpt_dir` (MP consolidated files), from params.json and the files beside it."""
    folder = Path(ckpt_dir)
    path = folder / "params.json"
    raw = _raw_params(path) if path.is_file() else {}  # a model built from ModelArgs alone reads shards only
    quant, lora = _entry(raw, "quantization_args"), _entry(raw, "lora_args")
    scale_files = {int(m.group(1)): p for p in folder.iterdir() if (m := FP8_SCALE_FILE.fullmatch(p.name))}
    if quant is None:
        if lora is not None:
            raise CheckpointError(f"{path}: lora_args without quantization_args: only Meta's int4 QLoRA checkpoints "
                                  "carry LoRA adaptors, and they have both")
        if not scale_files:
            return CheckpointFormat()
        missing = [m for m in range(mp) if m not in scale_files]
        if missing or max(scale_files) >= mp:
            wrong = missing or [max(scale_files)]
            what = "is missing" if missing else "has no consolidated file"
            raise CheckpointError(
                f"{folder}: an fp8 checkpoint needs fp8_scales_N.pt for each of its {mp} consolidated files; "
                f"fp8_scales_{wrong[0]}.pt {what}: the row scales of consolidated.{wrong[0]:02d}.pth's float8 weights")
        return CheckpointFormat("fp8", fp8_scales=tuple(scale_files[m] for m in range(mp)))
    if scale_files:
        raise CheckpointError(f"{folder}: both int4 quantization_args in params.json and fp8_scales files: "
                              "which format is it?")
    if not isinstance(quant, dict):
        raise CheckpointError(f"{path}: quantization_args must be an object, got {quant!r}")
    scheme = quant.get("scheme")
    if scheme is not None and scheme != INT4_SCHEME:
        raise CheckpointError(f"{path}: quantization_args.scheme {scheme!r} is unknown: tp-llama-serve serves "
                              f"Meta's {INT4_SCHEME!r} (int4 weights in groups, int8 activations per token)")
    group = _number(path, "quantization_args.group_size", quant.get("group_size"), int)
    spinquant = quant.get("spinquant")
    if spinquant is not None and not isinstance(spinquant, bool):
        raise CheckpointError(f"{path}: quantization_args.spinquant must be true or false, got {spinquant!r}")
    rank, scale = 0, 0.0
    if lora is not None:
        if not isinstance(lora, dict):
            raise CheckpointError(f"{path}: lora_args must be an object, got {lora!r}")
        rank = _number(path, "lora_args.rank", lora.get("rank"), int)
        scale = float(_number(path, "lora_args.scale", lora.get("scale"), float, positive=False))
    if spinquant is not None:
        hadamard, why = spinquant, "params.json quantization_args.spinquant"
    else:
        hadamard, why = lora is None, "no lora_args and no quantization_args.spinquant: Meta's SpinQuant download"
    return CheckpointFormat("int4", group, rank, scale, hadamard, why if hadamard else "")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the files: its full shape, the dtype a rank reads it into, its shard dim under TP."""

    full: tuple[int, ...]
    dtype: torch.dtype
    dim: int | None


def int4_specs(args: ModelArgs, fmt: CheckpointFormat, full: dict[str, tuple[int, ...]], tp_dims: dict[str, int | None],
               keys: set[str], first_file: Path) -> dict[str, TensorSpec]:
    """The int4 checkpoint's own tensors (weights, scales, zeros, adaptors), from the model's shapes
    (`full`, `tp_dims`: Meta's names, the 16-bit layout) and the keys of the first file (which hold
    zeros, which adaptor names). Scales and zeros split as their weight along the output rows, and
    along k with it (its groups), adaptor A along k and B along the output rows."""
    specs: dict[str, TensorSpec] = {}
    zeros = any(k.endswith(".zeros") for k in keys)
    names = next((pair for pair in ADAPTOR_NAMES if any(f".adaptor.{pair[0]}." in k for k in keys)), ADAPTOR_NAMES[0])
    for key, shape in full.items():
        dim = tp_dims[key]
        base = key.removesuffix(".weight")
        module = ".".join(base.split(".")[2:]) if base.startswith("layers.") else base
        if module in LINEARS:
            out, k = shape
            if k % fmt.group:
                raise CheckpointError(f"{first_file.parent / 'params.json'}: quantization_args.group_size "
                                      f"{fmt.group} does not divide k = {k} of tensor {key!r}")
            specs[key] = TensorSpec(shape, torch.int8, dim)
            specs[f"{base}.scales"] = TensorSpec((out, k // fmt.group), torch.float32, dim)
            if zeros:
                specs[f"{base}.zeros"] = TensorSpec((out, k // fmt.group), torch.float32, dim)
            if fmt.lora_rank:
                a, b = names
                specs[f"{base}.adaptor.{a}.weight"] = TensorSpec((fmt.lora_rank, k), torch.float32,
                                                                  1 if dim == 1 else None)
                specs[f"{base}.adaptor.{b}.weight"] = TensorSpec((out, fmt.lora_rank), torch.float32,
                                                                  0 if dim == 0 else None)
        elif module in INT8_TABLES:
            specs[key] = TensorSpec(shape, torch.int8, dim)
            scales = f"{base}.scales"
            if scales not in keys:
                raise CheckpointError(f"{first_file}: missing tensor {scales!r} (an int4 checkpoint's {module} is int8 "
                                      "with scales)")
            specs[scales] = TensorSpec((shape[0], 0), torch.float32, dim)  # its columns: table_scale_spec
    return specs


def table_scale_spec(spec: TensorSpec, stored: tuple[int, ...], weight: tuple[int, ...], mp: int, path: Path,
                     key: str) -> TensorSpec:
    """An int8 table's scales as the first file stores them ([rows], [rows, 1] or [rows, n]: n groups of
    a row), as a spec: split with the table's rows, or along its columns where a row has several."""
    rows, cols = weight
    n = 1 if len(stored) == 1 else stored[-1]
    split_rows = spec.dim == 0
    file_rows = rows // mp if split_rows else rows
    if len(stored) not in (1, 2) or stored[0] != file_rows or n == 0:
        raise CheckpointError(f"{path}: tensor {key!r} has shape {tuple(stored)}: an int8 table of {file_rows} rows "
                              f"here takes scales [{file_rows}], [{file_rows}, 1] or [{file_rows}, n]")
    n_full = n if split_rows or n == 1 else n * mp
    if cols % n_full:
        raise CheckpointError(f"{path}: tensor {key!r} has {n_full} scales a row, which do not divide its "
                              f"{cols} columns")
    dim = spec.dim if split_rows or n_full > 1 else None
    return TensorSpec((rows, n_full) if len(stored) == 2 else (rows,), torch.float32, dim)


def check_int4_file(specs: dict[str, TensorSpec], state: dict[str, torch.Tensor], group: int, path: Path) -> None:
    """A file's int4 tensors against the format: int8 values, and scales whose groups are params.json's."""
    for key, tensor in state.items():
        spec = specs.get(key)
        if spec is None:
            continue
        if spec.dtype == torch.int8 and tensor.dtype != torch.int8:
            raise CheckpointError(f"{path}: tensor {key!r} is {tensor.dtype}; an int4 checkpoint holds it as int8")
        if not key.endswith((".scales", ".zeros")) or key.startswith(INT8_TABLES):
            continue
        weight = state.get(key.rsplit(".", 1)[0] + ".weight")
        if weight is None or weight.dim() != 2 or tensor.dim() != 2:
            continue  # a missing or misshapen weight is named by the shape checks
        k = weight.shape[1]
        if tensor.shape[0] != weight.shape[0] or tensor.shape[1] * group != k:
            whole = tensor.shape[1] and not k % tensor.shape[1]
            groups = f"groups of {k // tensor.shape[1]}" if whole else "no whole groups"
            raise CheckpointError(f"{path}: tensor {key!r} has shape {tuple(tensor.shape)} for a weight of shape "
                                  f"{tuple(weight.shape)}: {groups} along k = {k}, but params.json's "
                                  f"quantization_args.group_size is {group}")
