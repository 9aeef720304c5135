"""The engine's settings: one object, built from the yaml's handler block or the command line, and
checked once, where it is built."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields

import torch

from tp_llama.kernels import C_KINDS, choose, cpu_flags
from tp_llama.kernels.quant import QUANTIZE

MODES = ("tp", "fsdp")
DEVICES = ("auto", "cpu", "cuda")  # auto: CUDA where this process sees a GPU
COMPILE = ("auto", "on", "off")  # auto: on for CUDA
SPECULATIVE = ("off", "ngram", "draft")  # off, n-gram prompt lookup (engine/speculate.py), a draft model (engine/draft.py)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def bounded(default: float, minimum: float) -> typing.Any:
    """A numeric setting with its default and least allowed value."""
    return field(default=default, metadata={"min": minimum})


def one_of(default: str | None, choices: tuple[str, ...]) -> typing.Any:
    return field(default=default, metadata={"choices": choices})


def check_fields(settings: object) -> None:
    """Each field of a settings dataclass against its type and its `min` / `choices`.

    Settings come from yaml and the command line, which guarantee no type. Messages begin with
    the field's name, so a caller can say where it came from (handler.max_seq_len ...).
    """
    hints = typing.get_type_hints(type(settings))
    for spec in fields(settings):
        name, value, kind = spec.name, getattr(settings, spec.name), hints[spec.name]
        if kind is int or kind is float:
            numeric = (int,) if kind is int else (int, float)
            noun = "an integer" if kind is int else "a finite number"
            if isinstance(value, bool) or not isinstance(value, numeric) or not math.isfinite(value):
                raise ValueError(f"{name} must be {noun}, got {value!r}")
            if value < spec.metadata.get("min", -math.inf):
                raise ValueError(f"{name} must be {noun} >= {spec.metadata['min']}, got {value!r}")
        elif kind is bool and not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        elif kind is str and (not isinstance(value, str) or not value):
            hint = " (YAML reads an unquoted off, on, yes or no as a boolean: quote it)" if isinstance(value, bool) else ""
            raise ValueError(f"{name} must be a non-empty string, got {value!r}{hint}")
        elif "choices" in spec.metadata and value not in spec.metadata["choices"]:
            if value is None and kind == (str | None):
                continue
            raise ValueError(f"{name} must be one of {spec.metadata['choices']}, got {value!r}")


def check_adapters(adapters: object, mode: str) -> None:
    """handler.lora_adapters: names to folders (or to mappings with `path`), in mode 'tp'."""
    if not isinstance(adapters, dict) or not all(isinstance(name, str) and name for name in adapters):
        raise ValueError(f"lora_adapters must map adapter names to folders, got {adapters!r}")
    for name, entry in adapters.items():
        path = entry.get("path") if isinstance(entry, dict) else entry
        if not isinstance(path, str) or not path:
            raise ValueError(f"lora_adapters.{name} must be a folder, or a mapping with `path`, got {entry!r}")
    if adapters and mode != "tp":
        raise ValueError("lora_adapters need mode 'tp' (the adapters hook the served model's own projections)")


@dataclass(frozen=True)
class EngineConfig:
    ckpt_dir: str  # params.json, tokenizer.model, consolidated.NN.pth
    mode: str = one_of("tp", MODES)  # tp: each rank reads its slices; fsdp: the seed converter and FSDP
    dtype: str | None = one_of(None, tuple(DTYPES))  # None: see resolve_dtype
    max_seq_len: int = bounded(2048, 2)  # the longest sequence: prompt + new tokens
    max_batch_size: int = bounded(64, 1)  # the most sequences running at once (the KV pool decides how many fit)
    prefill_budget: int = bounded(512, 1)  # rows per step, decode rows included
    device: str = one_of("auto", DEVICES)  # TorchServe's deviceType or the CLI's --device
    compile: str = one_of("auto", COMPILE)  # decode steps through torch.compile (CUDA graphs on CUDA)
    kv_cache_memory_gb: float = bounded(0.0, 0)  # the KV-cache pool per rank; 0: see kv_pool_bytes
    kv_block_size: int = bounded(16, 16)  # positions per KV-cache block, a multiple of 16
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before
    quantize: str = one_of("none", QUANTIZE)  # matmul weights quantized by each rank as it loads them
    speculative: str = one_of("off", SPECULATIVE)  # proposals verified several a step (engine/speculate.py)
    speculative_tokens: int = bounded(4, 1)  # proposals per decode row at most (ngram: until a run is all taken)
    ngram_min: int = bounded(2, 1)  # the shortest suffix n-gram that proposes
    ngram_max: int = bounded(4, 1)  # the longest suffix n-gram looked up first
    draft_ckpt_dir: str | None = None  # speculative "draft": its checkpoint; None: this one quantized int4
    # LoRA adapters resident from the start, by name: a folder (PEFT's or torchtune's files) or a mapping with
    # `path` and, for torchtune's Meta-format files, `lora_alpha` (tp_llama/lora/adapters.py).
    lora_adapters: dict | None = None
    max_lora_rank: int = bounded(16, 1)  # the largest rank an adapter may have: its slots are this wide
    max_loras: int = bounded(8, 1)  # adapters resident at once; the least recently used one leaves for another
    lora_folder: str | None = None  # lora_runtime_loading: the adapters it may load, by name (its subfolders)
    lora_runtime_loading: bool = False  # load_lora_adapter / unload_lora_adapter requests allowed (serving/lora_admin.py)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.kv_block_size % 16:
            raise ValueError(f"kv_block_size must be a multiple of 16, got {self.kv_block_size}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        if self.draft_ckpt_dir is not None and not isinstance(self.draft_ckpt_dir, str):
            raise ValueError(f"draft_ckpt_dir must be a folder's path, got {self.draft_ckpt_dir!r}")
        if self.speculative == "draft" and self.mode != "tp":
            raise ValueError("speculative 'draft' needs mode 'tp' (the draft is read by the tp loader)")
        if self.speculative == "draft" and not self.draft_ckpt_dir and self.quantize == "int4":
            raise ValueError("speculative 'draft' without draft_ckpt_dir drafts with this checkpoint at int4, "
                             "which quantize 'int4' already serves: name a smaller draft_ckpt_dir")
        if self.lora_adapters is not None:
            check_adapters(self.lora_adapters, self.mode)
        if self.lora_runtime_loading and not (isinstance(self.lora_folder, str) and self.lora_folder):
            raise ValueError("lora_runtime_loading needs lora_folder: the folder whose subfolders it may load by name")
        if self.lora_runtime_loading and self.mode != "tp":
            raise ValueError("lora_runtime_loading needs mode 'tp' (the adapters hook the served model's projections)")
        if self.quantize != "none" and self.mode != "tp":
            raise ValueError(f"quantize {self.quantize!r} needs mode 'tp' (fsdp mode loads the seed converter's "
                             "unquantized shards)")

    @property
    def blocks_per_sequence(self) -> int:
        """KV-cache blocks one sequence of max_seq_len takes."""
        return -(-self.max_seq_len // self.kv_block_size)


def cpu_streams_bf16(device: torch.device) -> bool:
    """A CPU where bfloat16 weights halve the bytes of a decode step at float32's arithmetic speed:
    one built for bfloat16 (avx512_bf16, AMX), or one that runs tp_llama's C kernels, which widen
    bfloat16 in registers (AVX2 and AVX-512: decode faster than in float32, prefill about level;
    bench/engine/generate.py --dtype bfloat16). Elsewhere bfloat16 goes through PyTorch's slow paths."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags or choose(device, torch.bfloat16)[0] in C_KINDS


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA and on CPUs that stream it (cpu_streams_bf16), float32 on other CPUs, unless asked otherwise."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" or cpu_streams_bf16(device) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]
