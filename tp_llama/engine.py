"""The engine: one loaded checkpoint plus its tokenizer, running step plans on every rank.

Rank 0 makes each step's plan (tp_llama.scheduler) and sends it to the other ranks in one
broadcast; every rank builds the same Batch from it and runs the same forward, and rank 0 picks
the tokens. The plan is the only thing ranks exchange besides the model's own collectives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tp_llama.distributed import DistInfo, broadcast_from_rank0, init_distributed, log, raise_if_any_rank_failed
from tp_llama.faults import inject_fault
from tp_llama.kernels import cpu_flags, warm_up
from tp_llama.loader import load_fsdp_model, load_tp_model
from tp_llama.model import Batch
from tp_llama.params import ModelArgs, read_params
from tp_llama.sampling import sample_rows
from tp_llama.scheduler import Row, Scheduler, Sequence, StepPlan
from tp_llama.tokenizer import Tokenizer, load_tokenizer

MODES = ("tp", "fsdp")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DEFAULT_MAX_SEQ_LEN = 2048
DEFAULT_SLOTS = 16
DEFAULT_PREFILL_BUDGET = 512


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX: a CPU built for bfloat16, where serving it halves the weight bytes per step."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA and on CPUs with native bfloat16, float32 on other CPUs, unless asked otherwise."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" or cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class StepStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0  # steps that held prompt tokens
    decode_tokens: int = 0
    decode_s: float = 0.0  # steps of decode rows only


class PlanWire:
    """A step plan as one fixed-size int64 tensor, so sending it is a single broadcast.

    Layout: [end, n_rows, n_tokens, rows x (slot, start, length, sample), tokens...].
    """

    def __init__(self, max_rows: int, max_tokens: int):
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.size = 3 + 4 * max_rows + max_tokens

    def encode(self, plan: StepPlan) -> torch.Tensor:
        tokens = [t for row in plan.rows for t in row.tokens]
        if len(plan.rows) > self.max_rows or len(tokens) > self.max_tokens:
            raise ValueError(f"plan of {len(plan.rows)} rows / {len(tokens)} tokens exceeds the wire's capacity")
        header = [int(plan.end), len(plan.rows), len(tokens)]
        rows = [v for row in plan.rows for v in (row.slot, row.start, len(row.tokens), int(row.sample))]
        wire = torch.zeros(self.size, dtype=torch.long)
        filled = header + rows
        wire[: len(filled)] = torch.tensor(filled, dtype=torch.long)
        wire[3 + 4 * self.max_rows : 3 + 4 * self.max_rows + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return wire

    def decode(self, wire: torch.Tensor) -> StepPlan:
        values = wire.tolist()
        end, n_rows, _ = values[:3]
        tokens = values[3 + 4 * self.max_rows :]
        rows, offset = [], 0
        for r in range(n_rows):
            slot, start, length, sample = values[3 + 4 * r : 7 + 4 * r]
            rows.append(Row(slot, start, tokens[offset : offset + length], bool(sample)))
            offset += length
        return StepPlan(rows, end=bool(end))


@dataclass
class Engine:
    model: nn.Module
    tokenizer: Tokenizer
    args: ModelArgs
    info: DistInfo
    max_seq_len: int
    max_batch_size: int  # KV-cache slots
    prefill_budget: int
    load_s: float
    stats: StepStats = field(default_factory=StepStats)

    def __post_init__(self) -> None:
        self.wire = PlanWire(self.max_batch_size, self.prefill_budget + self.max_batch_size)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @classmethod
    def load(
        cls,
        ckpt_dir: str | Path,
        mode: str = "tp",
        dtype: str | None = None,
        max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
        max_batch_size: int = DEFAULT_SLOTS,
        prefill_budget: int = DEFAULT_PREFILL_BUDGET,
    ) -> Engine:
        """Join the process group, read the checkpoint and build the model on every rank."""
        info = init_distributed(require_group=mode == "fsdp")
        started = time.perf_counter()
        log(f"loading {ckpt_dir} (mode={mode}, world_size={info.world_size}, device={info.device})", info.rank)
        error, setup = None, None
        try:
            if mode not in MODES:
                raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
            if max_seq_len < 2 or max_batch_size < 1 or prefill_budget < 1:
                raise ValueError("max_seq_len must be >= 2, max_batch_size and prefill_budget >= 1")
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
            model = load_tp_model(ckpt_dir, args, info, torch_dtype)
            kind, why = model.optimize_for_inference()
            log(f"matmuls: {kind}" + (f" ({why})" if why else ""), info.rank)
        else:
            model = load_fsdp_model(ckpt_dir, args, info, torch_dtype)
        tp_size = info.world_size if mode == "tp" else 1
        error = None
        try:
            model.setup_caches(max_batch_size, max_seq_len, torch_dtype, info.device, tp_size)
        except (RuntimeError, MemoryError) as exc:  # too many slots for this machine's memory
            error = MemoryError(
                f"the KV cache of {max_batch_size} slots x {max_seq_len} positions does not fit ({exc}); "
                "lower handler.max_batch_size or handler.max_seq_len"
            )
        raise_if_any_rank_failed(error)
        model.eval()
        if mode == "tp":
            warm_up(model.matmul_weights(), max_batch_size, torch_dtype)
        load_s = time.perf_counter() - started
        log(f"loaded in {load_s:.2f} s ({torch_dtype}, {max_batch_size} KV-cache slots of {max_seq_len})", info.rank)
        return cls(model, tokenizer, args, info, max_seq_len, max_batch_size, prefill_budget, load_s)

    def new_scheduler(self) -> Scheduler:
        return Scheduler(self.max_batch_size, self.max_seq_len, self.prefill_budget, self.tokenizer.stop_ids)

    @torch.inference_mode()
    def step(self, plan: StepPlan | None = None) -> tuple[StepPlan, list[int]]:
        """One step on every rank: rank 0 passes its plan, the others get it. Rank 0 gets the picked tokens."""
        inject_fault("decode", self.rank, self.device)
        if self.world_size > 1:
            wire = self.wire.encode(plan) if self.rank == 0 else torch.zeros(self.wire.size, dtype=torch.long)
            received = self.wire.decode(broadcast_from_rank0(wire, self.device))
            plan = plan if self.rank == 0 else received
        if not plan.rows:
            return plan, []
        started = time.perf_counter()
        rows = [(r.slot, r.start, r.tokens, r.sample) for r in plan.rows]
        logits = self.model(Batch.build(rows, self.device))
        picked: list[int] = []
        if self.rank == 0:
            settings = [(s.params.temperature, s.params.top_p, s.generator)
                        for r, s in zip(plan.rows, plan.sequences) if r.sample]
            picked = sample_rows(logits, settings)
        self._count(plan, time.perf_counter() - started)
        return plan, picked

    def _count(self, plan: StepPlan, seconds: float) -> None:
        stats = self.stats
        if plan.prompt_tokens:
            stats.prefill_tokens += plan.prompt_tokens
            stats.prefill_s += seconds
        else:
            stats.decode_tokens += len(plan.rows)
            stats.decode_s += seconds

    def follow(self) -> None:
        """Ranks > 0: run rank 0's plans until one hands control back."""
        while True:
            plan, _ = self.step()
            if plan.end:
                return

    def generate(
        self, sequences: list[Sequence], on_step: Callable[[list[Sequence]], None] | None = None
    ) -> list[Sequence]:
        """Schedule sequences to their end (every rank calls it; only rank 0's list matters)."""
        if self.rank != 0:
            self.follow()
            return sequences
        scheduler = self.new_scheduler()
        try:
            for seq in sequences:
                scheduler.add(seq)
        except ValueError:
            self.step(StepPlan([], end=True))  # the other ranks are waiting for a plan: let them go
            raise
        while scheduler.has_work():
            plan = scheduler.plan()
            plan.end = False
            _, picked = self.step(plan)
            touched = scheduler.commit(plan, picked)
            if on_step is not None:
                on_step(touched)
        self.step(StepPlan([], end=True))
        return sequences
