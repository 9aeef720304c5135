"""One rank's model, made ready to serve and then run step by step.

Getting ready, in order: in `tp` mode the serving modules swapped in for the matmul backend this
CPU or GPU runs best and the model moved to its device; the KV-cache pool sized and allocated
(every rank the same number of blocks); the kernels warmed up; the decode step compiled where it
runs compiled. Each step then sends rank 0's plan to every rank, builds the batch and runs the
forward.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from tp_llama import backend
from tp_llama.backend import Preparation
from tp_llama.config import EngineConfig
from tp_llama.engine.decode_step import DecodeStep
from tp_llama.engine.plan import PlanWire, Row, StepPlan
from tp_llama.engine.sampling import TokenLogprobs
from tp_llama.engine.scheduler import SPECULATE_STEP_TOKENS
from tp_llama.engine.scoring import row_entries, score_hidden, score_logits
from tp_llama.kernels import C_KINDS, warm_up
from tp_llama.lora.serve import ResidentAdapters, resident_adapters
from tp_llama.lora.slots import LoraStep
from tp_llama.kernels.cpu.ffi import library
from tp_llama.model import Batch, KVCache, ModelArgs
from tp_llama.pages import huge_page_bytes
from tp_llama.parallel.distributed import DistInfo, broadcast_from_rank0, every_rank_agrees, log, smallest_across_ranks

CPU_DEFAULT_SEQUENCES = 16  # the CPU pool's default: this many sequences of max_seq_len
GPU_FREE_FRACTION = 0.85  # of the memory free after the weights; the rest for activations and graphs
GPU_MOST_BATCHES = 4  # the GPU pool's default holds at most this many full batches of max_seq_len
INDEX_LIMIT = 2**31  # elements of one layer's keys that 32-bit offsets (Triton's kernels) reach


def wants_compile(config: EngineConfig, device: torch.device) -> bool:
    return config.compile == "on" or (config.compile == "auto" and device.type == "cuda")


def compiles_decode(config: EngineConfig, device: torch.device, kind: str | None,
                    args: ModelArgs | None = None, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """(whether decode steps run compiled at static shapes, why not where they do not).

    kind: the matmuls of the `tp` mode (None under FSDP, which runs eagerly). args, dtype: a Llama 4 compiles
    in bfloat16 (its experts' grouped matmuls), with chunks of whole KV blocks (the step's block masks).
    """
    if not wants_compile(config, device):
        return False, f"compile={config.compile}"
    if args is not None and args.family == "llama4":
        if dtype != torch.bfloat16:
            return False, "Llama 4's experts compile as grouped matmuls in bfloat16 only"
        partial = chunks_in_part_blocks(args, config)
        if partial:
            return False, partial
    if kind is None:
        return False, "fsdp mode runs eagerly"
    if kind in C_KINDS:
        return False, "the C kernels already run a decode step in one call"
    return True, ""


def chunks_in_part_blocks(args: ModelArgs, config: EngineConfig) -> str:
    """Why Llama 4's attention chunks end inside KV blocks ("" where they do not): the step's block masks and the
    C kernels' attention both read whole blocks from a chunk's first, so neither runs (PyTorch's attention does)."""
    chunk = args.attention_chunk_size if args.family == "llama4" else None
    if chunk and chunk % config.kv_block_size:
        return f"attention_chunk_size {chunk} is no whole number of {config.kv_block_size}-position KV blocks"
    return ""


def backend_preparation(config: EngineConfig, info: DistInfo, dtype: torch.dtype) -> Preparation:
    """How this rank prepares its model for serving (`tp` mode): block by block as the loader reads it,
    or whole (ModelRunner)."""
    return backend.preparation_for(info.device, dtype, traced=wants_compile(config, info.device),
                                   quantized=config.quantize)


def kv_pool_bytes(config: EngineConfig, info: DistInfo, token_bytes: int, held_apart: int = 0) -> int:
    """This rank's KV-cache pool: handler.kv_cache_memory_gb, or by default most of the GPU's free
    memory, or on CPU (where the pool is touched at load) the memory of CPU_DEFAULT_SEQUENCES full
    sequences, at most a quarter of RAM across the node's ranks.

    held_apart: bytes of the GPU's free memory spoken for already (a draft model's weights, moved to the
    GPU after this pool is sized). The GPU default stops at GPU_MOST_BATCHES full batches: past that,
    blocks only keep old prefixes, and every decode step's block mask grows with the pool (a small
    model would otherwise take a pool of 10^8 positions).
    """
    if config.kv_cache_memory_gb:
        return int(config.kv_cache_memory_gb * 2**30)
    if info.device.type == "cuda":
        most = GPU_MOST_BATCHES * config.max_batch_size * config.max_seq_len * token_bytes
        return min(int((torch.cuda.mem_get_info(info.device)[0] - held_apart) * GPU_FREE_FRACTION), most)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return min(CPU_DEFAULT_SEQUENCES * config.max_seq_len * token_bytes, ram // (4 * ranks_here))


def pool_blocks(config: EngineConfig, info: DistInfo, kv_width: int, block_bytes: int, held_apart: int = 0) -> int:
    """Blocks in this rank's pool: kv_pool_bytes' worth; on CUDA no more than 32-bit offsets reach with
    the spare block (kv_width: this rank's kv_heads * head_dim). Not on CPU: a pool too big for RAM
    must fail its allocation with a message, not be cut to a size Linux's OOM killer then ends."""
    blocks = kv_pool_bytes(config, info, block_bytes // config.kv_block_size, held_apart) // block_bytes
    if info.device.type == "cuda":
        blocks = min(blocks, INDEX_LIMIT // (kv_width * config.kv_block_size) - 1)
    return blocks


def block_bytes_of(args: ModelArgs, config: EngineConfig, kv_heads: int, dtype: torch.dtype) -> int:
    """The bytes of one KV-cache block of a rank's model (keys and values, every layer)."""
    return 2 * args.n_layers * kv_heads * config.kv_block_size * args.head_dim * dtype.itemsize


@dataclass(frozen=True)
class PoolShare:
    """How a rank's KV-cache pool is sized beside a draft model's, whose blocks mirror the served model's
    (the same block tables address both): the served model counts `beside_bytes` more a block, so both
    caches fit the memory set for one, and leaves `weights_bytes` (the draft's weights, not on the GPU
    yet) out of a GPU's free memory; the draft takes `n_blocks`, the served model's count, or, where it
    is the served checkpoint itself, `caches_of` the served model (engine/draft.py)."""

    beside_bytes: int = 0
    weights_bytes: int = 0
    n_blocks: int = 0
    caches_of: nn.Module | None = None


class ModelRunner:
    """A rank's model ready to serve (built by `__init__`, see the module's docstring) and its steps."""

    def __init__(self, model: nn.Module, config: EngineConfig, info: DistInfo, args: ModelArgs,
                 n_words: int | None = None, prepared: Preparation | None = None, pool: PoolShare | None = None,
                 adapters: bool = False):
        """pool: how the KV-cache pool is sized beside a draft model (PoolShare, engine/draft.py); adapters: the
        yaml's LoRA adapters made resident (the served model's runner, not a draft's), before the pool is sized
        (their slots take device memory) and before decode steps are captured (their graphs read the slots)."""
        self.model, self.info = model, info
        self.mode = config.mode
        self.n_words = args.vocab_size if n_words is None else n_words  # the ids prompt log-probabilities range over
        kind = self._swap_in_modules(config, prepared) if config.mode == "tp" else None
        self.adapters: ResidentAdapters | None = None
        if adapters:
            with every_rank_agrees():
                self.adapters = resident_adapters(config, model, args, info, self.dtype)
        self.lora: LoraStep | None = self.adapters.step if self.adapters is not None else None
        compiled, why = compiles_decode(config, info.device, kind, args, self.dtype)
        log(f"decode steps: {'compiled' if compiled else 'eager'}" + (f" ({why})" if why else ""), info.rank)
        partial = chunks_in_part_blocks(args, config)
        if kind in C_KINDS and partial:  # backend/llama4.py's ServingAttention
            log(f"attention: PyTorch's, not the C kernels' ({partial}): a row's bits then depend on its batch",
                info.rank)
        self.cache = self._allocate_pool(config, args, pool or PoolShare())
        model.eval()
        if config.mode == "tp":
            warm_up(backend.matmul_weights(model), config.max_batch_size, self.dtype)
        self.decode_step = self._capture(config) if compiled else None
        self.wire = PlanWire(config.max_batch_size, 2 * config.prefill_budget + config.max_batch_size,
                             config.max_batch_size * config.blocks_per_sequence)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _swap_in_modules(self, config: EngineConfig, prepared: Preparation | None) -> str:
        """Swap the serving modules in on the host (unless the loader did as it read the model:
        `prepared`), then move the model to its device; the matmul kind."""
        info = self.info
        with every_rank_agrees():
            if prepared is None:
                prepared = backend_preparation(config, info, self.dtype)
                prepared.apply(self.model)
            why = prepared.why
            if prepared.kind in C_KINDS:
                chunks = library().next_tile_min_chunks
                ahead = "every call" if chunks == 1 else f"calls of {chunks} chunks of rows or more"
                build = f"{library().variant} build of the C kernels; the next tile prefetched in {ahead}"
                why = f"{why}; {build}" if why else build  # why: a forced kind it could not have
            weights = f", {config.quantize} weights" if config.quantize != "none" else ""
            log(f"matmuls: {prepared.kind}{weights}" + (f" ({why})" if why else ""), info.rank)
            self.model.to(info.device)
        return prepared.kind

    def _allocate_pool(self, config: EngineConfig, args: ModelArgs, share: PoolShare) -> KVCache:
        """The KV-cache pool, every rank the same number of blocks (the fewest any rank has room for)."""
        if share.caches_of is not None:
            self.model.share_caches(share.caches_of)
            log("KV cache: the served model's", self.info.rank)
            return self.model.layers[0].attention.cache
        info, dtype = self.info, self.dtype
        kv_heads = args.n_kv_heads // (info.world_size if config.mode == "tp" else 1)
        block_bytes = block_bytes_of(args, config, kv_heads, dtype)
        n_blocks = 0
        with every_rank_agrees():
            try:
                n_blocks = share.n_blocks or smallest_across_ranks(
                    pool_blocks(config, info, kv_heads * args.head_dim, block_bytes + share.beside_bytes,
                                share.weights_bytes), info.device)
                needed = config.blocks_per_sequence
                if n_blocks < needed:
                    raise MemoryError(f"a KV-cache pool of {n_blocks} blocks of {config.kv_block_size} positions "
                                      f"cannot hold one sequence of max_seq_len {config.max_seq_len} ({needed} blocks, "
                                      f"{needed * block_bytes / 2**30:.2f} GiB per rank); raise "
                                      "handler.kv_cache_memory_gb or lower handler.max_seq_len")
                self.model.setup_caches(config.max_seq_len, n_blocks, config.kv_block_size, dtype, info.device,
                                        kv_heads)
            except RuntimeError as exc:  # more than this machine's memory
                raise MemoryError(f"the KV-cache pool of {n_blocks} blocks x {config.kv_block_size} positions does "
                                  f"not fit ({exc}); lower handler.kv_cache_memory_gb") from exc
        log(f"KV cache: {n_blocks} blocks of {config.kv_block_size} positions ({n_blocks * config.kv_block_size} "
            f"tokens, {n_blocks * block_bytes / 2**30:.2f} GiB per rank), prefix caching "
            f"{'on' if config.prefix_caching else 'off'}", info.rank)
        huge = huge_page_bytes() if info.device.type == "cpu" else None
        if huge is not None:
            log(f"memory on 2 MiB pages: {huge / 2**30:.2f} GiB (the tiled weights ask for them)", info.rank)
        return self.model.layers[0].attention.cache

    def _capture(self, config: EngineConfig) -> DecodeStep:
        """The decode step compiled for every bucket of rows now, not when the first request meets it; with
        speculative decoding, buckets up to the positions a step of proposals may reach."""
        positions = max(config.max_batch_size, SPECULATE_STEP_TOKENS if config.speculative != "off" else 0)
        step = DecodeStep(self.model, positions, config.blocks_per_sequence, self.info.device, compiled=True,
                          lora=self.lora)
        started = time.perf_counter()
        step.warm_up()
        log(f"compiled {len(step.sizes)} decode-step sizes {step.sizes} in {time.perf_counter() - started:.1f} s",
            self.info.rank)
        return step

    def exchange(self, plan: StepPlan | None = None) -> StepPlan:
        """Rank 0's plan, sent to every rank in one broadcast (two at long contexts: PlanWire); the other ranks pass
        None and get it."""
        if self.info.world_size > 1:
            if self.info.rank == 0:
                for part in self.wire.encode(plan):
                    broadcast_from_rank0(part, self.info.device)
            else:
                wire = broadcast_from_rank0(torch.zeros(self.wire.size, dtype=torch.long), self.info.device)
                parts = [wire]
                if rest := self.wire.rest_size(wire):
                    parts.append(broadcast_from_rank0(torch.zeros(rest, dtype=torch.long), self.info.device))
                plan = self.wire.decode(parts)
        return plan

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[StepPlan, torch.Tensor | None, list[list[TokenLogprobs] | None]]:
        """The plan's forward on this rank.

        Returns the plan, the logits of its sampling rows (None for a plan without rows) and, on rank 0,
        each row's prompt log-probabilities (None for rows that score nothing, and on other ranks).
        """
        if plan.copies:
            self._copy_blocks(plan.copies)
        unscored: list[list[TokenLogprobs] | None] = [None] * len(plan.rows)
        if not plan.rows:
            return plan, None, unscored
        if any(row.score >= 0 for row in plan.rows):
            logits, scores = self._scoring_step(plan.rows)
            return plan, logits, row_entries(plan.rows, scores)
        if self.decode_step is not None and self.decode_step.accepts(plan.rows):
            if self.lora is not None:
                self.lora.begin(None, [])  # base rows only: no adapted projection reads the last step's slots
            return plan, self.decode_step(plan.rows), unscored
        return plan, self.model(self._batch(plan.rows)), unscored

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """The plan's block copies (src, dst), in every layer's cache, before its forward."""
        src, dst = torch.tensor(pairs, dtype=torch.long).to(self.info.device).t()
        for layer in self.model.layers:
            layer.attention.cache.copy_blocks(src, dst)

    def _batch(self, rows: list[Row], all_logits: bool = False) -> Batch:
        """The rows' batch, its tokens' adapter slots handed to the adapted projections (lora/slots.py)."""
        spec = [(r.start, r.tokens, r.logits_wanted, r.blocks) for r in rows]
        batch = Batch.build(spec, self.cache.block_size, self.cache.spare, self.info.device, all_logits=all_logits,
                            adapters=[r.adapter for r in rows] if self.lora is not None else None,
                            decoded=[r.decoded for r in rows])
        if self.lora is not None:
            self.lora.begin(batch.adapters, batch.adapter_groups)
        return batch

    def _scoring_step(self, rows: list[Row]) -> tuple[torch.Tensor, tuple | None]:
        """A step with prompt rows to score: every position's final hidden state, the sampling rows'
        logits from it as in any step, and the scored positions' log-probabilities (scoring.py)."""
        at, sample_at, score_at, targets = 0, [], [], []
        for row in rows:
            sample_at += range(at + len(row.tokens) - row.logits_wanted, at + len(row.tokens))
            if row.score >= 0:
                score_at += range(at, at + row.scored)
                targets += row.targets()
            at += len(row.tokens)
        top = max(row.score for row in rows)
        batch = self._batch(rows, all_logits=True)
        if self.mode != "tp":  # fsdp wraps the whole model: its forward alone gathers the parameters
            logits = self.model(batch)
            scores = score_logits(logits[score_at], targets, top, self.n_words) if self.info.rank == 0 else None
            return logits[sample_at], scores
        hidden = self.model.hidden(batch)
        return self.model.output(hidden[sample_at]).float(), score_hidden(self.model.output, hidden[score_at], targets,
                                                                          top, self.n_words)
