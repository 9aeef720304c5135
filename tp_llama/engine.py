"""The engine: one loaded checkpoint plus its tokenizer, ready to generate on every rank."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn

from tp_llama.distributed import DistInfo, init_distributed, log, raise_if_any_rank_failed
from tp_llama.faults import inject_fault
from tp_llama.generation import GenerationRequest, GenerationResult, GenerationStats, generate
from tp_llama.loader import load_fsdp_model, load_tp_model
from tp_llama.parallel import localize
from tp_llama.params import ModelArgs, read_params
from tp_llama.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Engine", "GenerationRequest", "GenerationResult"]

MODES = ("tp", "fsdp")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA and float32 on CPU unless asked otherwise."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class Engine:
    model: nn.Module
    tokenizer: Tokenizer
    args: ModelArgs
    info: DistInfo
    max_seq_len: int
    max_batch_size: int
    load_s: float
    stats: GenerationStats = field(default_factory=GenerationStats)
    busy_slots: int = 0  # KV-cache rows held by the generate call in progress

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def device(self) -> torch.device:
        return self.info.device

    @classmethod
    def load(
        cls,
        ckpt_dir: str | Path,
        mode: str = "tp",
        dtype: str | None = None,
        max_seq_len: int = 2048,
        max_batch_size: int = 8,
    ) -> Engine:
        """Join the process group, read the checkpoint and build the model on every rank."""
        info = init_distributed(require_group=mode == "fsdp")
        started = time.perf_counter()
        log(f"loading {ckpt_dir} (mode={mode}, world_size={info.world_size}, device={info.device})", info.rank)
        error, setup = None, None
        try:
            if mode not in MODES:
                raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
            if max_seq_len < 2 or max_batch_size < 1:
                raise ValueError("max_seq_len must be >= 2 and max_batch_size >= 1")
            torch_dtype = resolve_dtype(dtype, info.device)
            inject_fault("load", info.rank, info.device)
            tokenizer = load_tokenizer(Path(ckpt_dir) / "tokenizer.model")
            args = read_params(ckpt_dir, tokenizer.n_words)
            setup = (torch_dtype, tokenizer, args)
        except Exception as exc:  # every rank must hear of it, or the others wait in the next collective
            error = exc
        raise_if_any_rank_failed(error)
        torch_dtype, tokenizer, args = setup
        if mode == "tp":
            # Loaded as DTensors, run as plain local shards with explicit collectives (much faster).
            model = localize(load_tp_model(ckpt_dir, args, info, torch_dtype))
        else:
            model = load_fsdp_model(ckpt_dir, args, info, torch_dtype)
        tp_size = info.world_size if mode == "tp" else 1
        model.setup_caches(max_batch_size, max_seq_len, torch_dtype, info.device, tp_size)
        model.eval()
        load_s = time.perf_counter() - started
        log(f"loaded in {load_s:.2f} s", info.rank)
        return cls(model, tokenizer, args, info, max_seq_len, max_batch_size, load_s)

    def generate(
        self,
        requests: list[GenerationRequest],
        on_tokens: Callable[[list[list[int]]], None] | None = None,
    ) -> list[GenerationResult]:
        """Any number of requests, run max_batch_size at a time; identical calls on every rank."""
        results: list[GenerationResult] = []
        for first in range(0, len(requests), self.max_batch_size):
            chunk = requests[first : first + self.max_batch_size]
            relay = None if on_tokens is None else partial(_relay, on_tokens, len(requests), first)
            self.busy_slots += len(chunk)
            try:
                results += generate(self.model, chunk, self.tokenizer.stop_ids, self.device, self.rank, relay, self.stats)
            finally:
                self.busy_slots -= len(chunk)
        return results


def _relay(on_tokens: Callable[[list[list[int]]], None], total: int, offset: int, new_tokens: list[list[int]]) -> None:
    """Report a chunk's step in the caller's numbering: one list per request of the whole call."""
    padded: list[list[int]] = [[] for _ in range(total)]
    padded[offset : offset + len(new_tokens)] = new_tokens
    on_tokens(padded)
