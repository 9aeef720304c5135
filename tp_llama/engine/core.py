"""The engine: one loaded checkpoint plus its tokenizer, and the one step loop every caller runs.

Rank 0 makes each step's plan (tp_llama.engine.scheduler) and sends it to the other ranks in one
broadcast; every rank builds the same Batch from it and runs the same forward, and rank 0 picks
the tokens. The plan is the only thing ranks exchange besides the model's own collectives. The
offline CLI and the TorchServe handler both drive steps through `Engine.run`, which always ends
by releasing the other ranks.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tp_llama import backend
from tp_llama.checkpoint.loader import load_fsdp_model, load_tp_model
from tp_llama.checkpoint.params import check_tokenizer_fits, read_params
from tp_llama.config import EngineConfig, resolve_dtype
from tp_llama.engine.blocks import BlockPool
from tp_llama.engine.decode_step import DecodeStep
from tp_llama.engine.plan import StepPlan
from tp_llama.engine.runner import ModelRunner
from tp_llama.engine.sampling import sample_rows
from tp_llama.engine.scheduler import Scheduled, Scheduler, Sequence
from tp_llama.kernels import warm_up
from tp_llama.kernels.cpu.ffi import library
from tp_llama.model import KVCache, ModelArgs
from tp_llama.pages import huge_page_bytes
from tp_llama.parallel.distributed import (DistInfo, init_distributed, log, raise_if_any_rank_failed,
                                          smallest_across_ranks)
from tp_llama.tokenizer import Tokenizer, load_tokenizer


@dataclass
class StepStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0  # steps that held prompt tokens
    decode_tokens: int = 0
    decode_s: float = 0.0  # steps of decode rows only


def wants_compile(config: EngineConfig, device: torch.device) -> bool:
    return config.compile == "on" or (config.compile == "auto" and device.type == "cuda")


def compiles_decode(config: EngineConfig, device: torch.device, kind: str | None) -> tuple[bool, str]:
    """(whether decode steps run compiled at static shapes, why not where they do not).

    kind: the matmuls of the `tp` mode (None under FSDP, which runs eagerly).
    """
    if not wants_compile(config, device):
        return False, f"compile={config.compile}"
    if kind is None:
        return False, "fsdp mode runs eagerly"
    if kind in ("amx", "tiles"):
        return False, "the C kernels already run a decode step in one call"
    return True, ""


CPU_DEFAULT_SEQUENCES = 16  # the CPU pool's default: this many sequences of max_seq_len
GPU_FREE_FRACTION = 0.85  # of the memory free after the weights; the rest for activations and graphs
GPU_MOST_BATCHES = 4  # the GPU pool's default holds at most this many full batches of max_seq_len
INDEX_LIMIT = 2**31  # elements of one layer's keys that 32-bit offsets (Triton's kernels) reach


def kv_pool_bytes(config: EngineConfig, info: DistInfo, token_bytes: int) -> int:
    """This rank's KV-cache pool: handler.kv_cache_memory_gb, or by default most of the GPU's free
    memory, or on CPU (where the pool is touched at load) the memory of CPU_DEFAULT_SEQUENCES full
    sequences, at most a quarter of RAM across the node's ranks.

    The GPU default stops at GPU_MOST_BATCHES full batches: past that, blocks only keep old prefixes,
    and every decode step's block mask grows with the pool (a small model would otherwise take a
    pool of 10^8 positions).
    """
    if config.kv_cache_memory_gb:
        return int(config.kv_cache_memory_gb * 2**30)
    if info.device.type == "cuda":
        most = GPU_MOST_BATCHES * config.max_batch_size * config.max_seq_len * token_bytes
        return min(int(torch.cuda.mem_get_info(info.device)[0] * GPU_FREE_FRACTION), most)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return min(CPU_DEFAULT_SEQUENCES * config.max_seq_len * token_bytes, ram // (4 * ranks_here))


def pool_blocks(config: EngineConfig, info: DistInfo, kv_width: int, block_bytes: int) -> int:
    """Blocks in this rank's pool: kv_pool_bytes' worth; on CUDA no more than 32-bit offsets reach with
    the spare block (kv_width: this rank's kv_heads * head_dim). Not on CPU: a pool too big for RAM
    must fail its allocation with a message, not be cut to a size Linux's OOM killer then ends."""
    blocks = kv_pool_bytes(config, info, block_bytes // config.kv_block_size) // block_bytes
    if info.device.type == "cuda":
        blocks = min(blocks, INDEX_LIMIT // (kv_width * config.kv_block_size) - 1)
    return blocks


def load_model(config: EngineConfig, info: DistInfo) -> tuple[nn.Module, Tokenizer, ModelArgs, bool]:
    """The checkpoint's model on this rank, ready to serve (see `ready_to_serve`)."""
    error, setup = None, None
    try:
        dtype = resolve_dtype(config.dtype, info.device)
        tokenizer = load_tokenizer(Path(config.ckpt_dir) / "tokenizer.model")
        args = read_params(config.ckpt_dir, tokenizer.n_words)
        check_tokenizer_fits(tokenizer, args, config.ckpt_dir)
        setup = (dtype, tokenizer, args)
    except Exception as exc:  # every rank must hear of it, or the others wait in the next collective
        error = exc
    raise_if_any_rank_failed(error)
    dtype, tokenizer, args = setup
    if config.mode == "tp":
        model = load_tp_model(config.ckpt_dir, args, info, dtype)
    else:
        model = load_fsdp_model(config.ckpt_dir, args, info, dtype)
    return model, tokenizer, args, ready_to_serve(model, config, info, args)


def ready_to_serve(model: nn.Module, config: EngineConfig, info: DistInfo, args: ModelArgs) -> bool:
    """In `tp` mode, swap the serving modules in on the host and move the model to its device; then
    allocate the KV-cache pool, every rank the same number of blocks. Returns whether decode steps
    run compiled."""
    kind = None
    if config.mode == "tp":
        error = None
        try:
            kind, why = backend.optimize(model, info.device, traced=wants_compile(config, info.device))
            if kind in ("amx", "tiles"):
                chunks = library().next_tile_min_chunks
                ahead = "every call" if chunks == 1 else f"calls of {chunks} chunks of rows or more"
                why = f"{library().variant} build of the C kernels; the next tile prefetched in {ahead}"
            log(f"matmuls: {kind}" + (f" ({why})" if why else ""), info.rank)
            model.to(info.device)
        except Exception as exc:  # a rank that fails here must not leave the others in a collective
            error = exc
        raise_if_any_rank_failed(error)
    compiled, why = compiles_decode(config, info.device, kind)
    log(f"decode steps: {'compiled' if compiled else 'eager'}" + (f" ({why})" if why else ""), info.rank)
    dtype = next(model.parameters()).dtype
    kv_heads = args.n_kv_heads // (info.world_size if config.mode == "tp" else 1)
    block_bytes = 2 * args.n_layers * kv_heads * config.kv_block_size * args.head_dim * dtype.itemsize
    error, n_blocks = None, 0
    try:
        n_blocks = smallest_across_ranks(pool_blocks(config, info, kv_heads * args.head_dim, block_bytes), info.device)
        needed = config.blocks_per_sequence
        if n_blocks < needed:
            raise MemoryError(f"a KV-cache pool of {n_blocks} blocks of {config.kv_block_size} positions cannot hold "
                              f"one sequence of max_seq_len {config.max_seq_len} ({needed} blocks, "
                              f"{needed * block_bytes / 2**30:.2f} GiB per rank); raise handler.kv_cache_memory_gb "
                              "or lower handler.max_seq_len")
        model.setup_caches(config.max_seq_len, n_blocks, config.kv_block_size, dtype, info.device, kv_heads)
    except (RuntimeError, MemoryError) as exc:  # more than this machine's memory
        error = exc if isinstance(exc, MemoryError) else MemoryError(
            f"the KV-cache pool of {n_blocks} blocks x {config.kv_block_size} positions does not fit ({exc}); "
            "lower handler.kv_cache_memory_gb")
    raise_if_any_rank_failed(error)
    log(f"KV cache: {n_blocks} blocks of {config.kv_block_size} positions ({n_blocks * config.kv_block_size} "
        f"tokens, {n_blocks * block_bytes / 2**30:.2f} GiB per rank), prefix caching "
        f"{'on' if config.prefix_caching else 'off'}", info.rank)
    huge = huge_page_bytes() if info.device.type == "cpu" else None
    if huge is not None:
        log(f"memory on 2 MiB pages: {huge / 2**30:.2f} GiB (the tiled weights ask for them)", info.rank)
    model.eval()
    if config.mode == "tp":
        warm_up(backend.matmul_weights(model), config.max_batch_size, dtype)
    return compiled


@dataclass
class Engine:
    config: EngineConfig
    model: nn.Module
    tokenizer: Tokenizer
    args: ModelArgs
    info: DistInfo
    load_s: float
    decode_step: DecodeStep | None = None
    stats: StepStats = field(default_factory=StepStats)

    def __post_init__(self) -> None:
        c = self.config
        self.runner = ModelRunner(self.model, self.info, c.max_batch_size, c.prefill_budget + c.max_batch_size,
                                  c.max_batch_size * c.blocks_per_sequence, self.decode_step)
        self._last_step_s = 0.0

    @property
    def cache(self) -> KVCache:
        return self.model.layers[0].attention.cache

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        """Join the process group, read the checkpoint and build the model on every rank."""
        info = init_distributed(config.device, require_group=config.mode == "fsdp")
        started = time.perf_counter()
        log(f"loading {config.ckpt_dir} (mode={config.mode}, world_size={info.world_size}, device={info.device})",
            info.rank)
        model, tokenizer, args, compiled = load_model(config, info)
        return cls.around(config, model, tokenizer, args, info, compiled, started)

    @classmethod
    def around(cls, config: EngineConfig, model: nn.Module, tokenizer: Tokenizer, args: ModelArgs, info: DistInfo,
               compiled: bool, started: float) -> Engine:
        """The engine of a model made ready by `ready_to_serve` (its decode steps compiled now, if so)."""
        decode_step = None
        if compiled:
            decode_step = DecodeStep(model, config.max_batch_size, config.blocks_per_sequence, info.device,
                                     compiled=True)
            warm_started = time.perf_counter()
            decode_step.warm_up()
            log(f"compiled {len(decode_step.sizes)} decode-step sizes {decode_step.sizes} in "
                f"{time.perf_counter() - warm_started:.1f} s", info.rank)
        load_s = time.perf_counter() - started
        log(f"loaded in {load_s:.2f} s ({next(model.parameters()).dtype}, up to {config.max_batch_size} sequences "
            f"of {config.max_seq_len})", info.rank)
        return cls(config, model, tokenizer, args, info, load_s, decode_step)

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

    def new_scheduler(self) -> Scheduler:
        c = self.config
        pool = BlockPool(self.cache.n_blocks, c.kv_block_size, c.prefix_caching)
        return Scheduler(c.max_batch_size, c.max_seq_len, c.prefill_budget, self.tokenizer.stop_ids, pool)

    def run(self, scheduler: Scheduler, budget_s: float = math.inf, until_finished: bool = False,
            on_step: Callable[[list[Sequence]], None] | None = None) -> None:
        """Rank 0: steps until the scheduler has no work left, until one more step would pass
        `budget_s`, or (until_finished) until a sequence finishes; the other ranks follow.

        The last plan sent has `end` set, so no other rank is left waiting for a plan.
        """
        started = time.perf_counter()
        while True:
            step_started = time.perf_counter()
            scheduled = scheduler.schedule()
            # The last step unless one more would still end within the budget (a step takes about as
            # long as the one before).
            end = step_started - started + 2 * self._last_step_s > budget_s
            picked, logprobs = self._lead(scheduled, end)
            self._last_step_s = time.perf_counter() - step_started
            touched = scheduler.commit(scheduled, picked, logprobs)
            if on_step is not None:
                on_step(touched)
            if end:
                return
            if not scheduler.has_work() or (until_finished and any(seq.finished for seq in touched)):
                self.release()
                return

    def release(self) -> None:
        """Rank 0: hand the other ranks back to their callers (a step of no rows, with `end`)."""
        self.runner.run(StepPlan([], end=True))

    def follow(self) -> None:
        """Ranks > 0: run rank 0's plans until one hands control back."""
        while not self.runner.run()[0].end:
            pass

    def generate(self, sequences: list[Sequence],
                 on_step: Callable[[list[Sequence]], None] | None = None) -> list[Sequence]:
        """Schedule sequences to their end (every rank calls it; only rank 0's list matters)."""
        if self.rank != 0:
            self.follow()
            return sequences
        scheduler = self.new_scheduler()
        try:
            for seq in sequences:
                scheduler.add(seq)
        except ValueError:
            self.release()  # the other ranks are waiting for a plan: let them go
            raise
        self.run(scheduler, on_step=on_step)
        return sequences

    def _lead(self, scheduled: Scheduled, end: bool) -> tuple[list[int], list]:
        """Rank 0's step: the plan out to every rank, the forward, one token picked per sampling row
        (with its log-probabilities where the sequence asks)."""
        started = time.perf_counter()
        _, logits = self.runner.run(StepPlan(scheduled.rows, end))
        sampling = [seq for row, seq in zip(scheduled.rows, scheduled.sequences) if row.sample]
        picked, logprobs = sample_rows(logits, sampling) if logits is not None else ([], [])
        seconds = time.perf_counter() - started
        if scheduled.prompt_tokens:
            self.stats.prefill_tokens += scheduled.prompt_tokens
            self.stats.prefill_s += seconds
        elif scheduled.rows:
            self.stats.decode_tokens += len(scheduled.rows)
            self.stats.decode_s += seconds
        return picked, logprobs
