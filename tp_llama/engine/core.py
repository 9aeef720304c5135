"""The engine: one loaded checkpoint plus its tokenizer, and the one step loop every caller runs.

Rank 0 makes each step's plan (tp_llama.engine.scheduler) and sends it to the other ranks in one
broadcast; every rank builds the same Batch from it and runs the same forward, and rank 0 picks
the tokens. The plan is the only thing ranks exchange besides the model's own collectives. The
offline CLI and the TorchServe handler both drive steps through `Engine.run`, which always ends
by releasing the other ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tp_llama.backend import Preparation
from tp_llama.checkpoint.loader import load_fsdp_model, load_tp_model
from tp_llama.checkpoint.params import check_tokenizer_fits, read_params
from tp_llama.config import EngineConfig, resolve_dtype
from tp_llama.engine.blocks import BlockPool
from tp_llama.engine.decode_step import DecodeStep
from tp_llama.engine.draft import SELF_DRAFT_QUANTIZE, Drafter, load_draft
from tp_llama.engine.plan import Row, StepPlan
from tp_llama.engine.runner import ModelRunner, PoolShare, backend_preparation, block_bytes_of
from tp_llama.engine.scheduler import Scheduled, Scheduler, Sequence
from tp_llama.engine.speculate import Speculator
from tp_llama.engine.verify import verify_rows
from tp_llama.lora.serve import ResidentAdapters
from tp_llama.lora.slots import AdapterRef
from tp_llama.model import KVCache, ModelArgs
from tp_llama.parallel.distributed import (DistInfo, every_rank_agrees, init_distributed, log, object_from_rank0,
                                           smallest_across_ranks)
from tp_llama.tokenizer import Tokenizer, load_tokenizer


@dataclass
class StepStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0  # steps that held prompt tokens
    decode_tokens: int = 0
    decode_s: float = 0.0  # steps of decode rows only
    proposed: int = 0  # speculative decoding's proposals, and those taken
    accepted: int = 0
    forced: int = 0  # grammars' forced tokens, taken without a draw (engine/constraint.py)


def load_model(config: EngineConfig, info: DistInfo) -> tuple[nn.Module, Tokenizer, ModelArgs, Preparation | None]:
    """The checkpoint's tokenizer, hyper-parameters and this rank's model: in `tp` mode on the host,
    each block prepared for serving as it is read (the Preparation)."""
    with every_rank_agrees():
        dtype = resolve_dtype(config.dtype, info.device)
        tokenizer = load_tokenizer(Path(config.ckpt_dir) / "tokenizer.model")
        args = read_params(config.ckpt_dir, tokenizer.n_words)
        check_tokenizer_fits(tokenizer, args, config.ckpt_dir)
        prepared = backend_preparation(config, info, dtype) if config.mode == "tp" else None
    if prepared is not None:
        return load_tp_model(config.ckpt_dir, args, info, dtype, prepared), tokenizer, args, prepared
    return load_fsdp_model(config.ckpt_dir, args, info, dtype), tokenizer, args, None


@dataclass
class Engine:
    config: EngineConfig
    runner: ModelRunner
    tokenizer: Tokenizer
    args: ModelArgs
    info: DistInfo
    load_s: float
    draft: ModelRunner | None = None  # a draft model's, proposing for speculative decoding (engine/draft.py)
    stats: StepStats = field(default_factory=StepStats)
    lora: ResidentAdapters | None = None  # the LoRA adapters' slots (lora/serve.py)

    def __post_init__(self) -> None:
        self._last_step_s = 0.0
        self._masks = None  # rank 0's grammar-mask worker, made with the first constrained row
        # Rank 0: the adapters requests may name, each with its files (the yaml's, then those loaded while serving).
        self.catalog: dict[str, object] = dict(self.config.lora_adapters or {})

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        """Join the process group, read the checkpoint, build the model on every rank and make it ready."""
        info = init_distributed(config.device, require_group=config.mode == "fsdp")
        started = time.perf_counter()
        log(f"loading {config.ckpt_dir} (mode={config.mode}, world_size={info.world_size}, device={info.device})",
            info.rank)
        model, tokenizer, args, prepared = load_model(config, info)
        draft = None
        if config.speculative == "draft":
            log(f"loading the draft: {config.draft_ckpt_dir or f'{config.ckpt_dir} at {SELF_DRAFT_QUANTIZE}'}",
                info.rank)
            draft = load_draft(config, tokenizer, lambda settings: load_model(settings, info))
        return cls.from_model(config, model, tokenizer, args, info, started, prepared, draft)

    @classmethod
    def from_model(cls, config: EngineConfig, model: nn.Module, tokenizer: Tokenizer, args: ModelArgs,
                   info: DistInfo, started: float, prepared: Preparation | None = None,
                   draft: tuple[EngineConfig, nn.Module, ModelArgs, Preparation | None] | None = None) -> Engine:
        """The engine of a built model (and its draft's), made ready to serve now (ModelRunner; `prepared`:
        the loader already applied it)."""
        share = PoolShare()
        if draft is not None:  # its weights, and its KV blocks (which mirror ours) where not ours, in one pool's memory
            _, draft_model, draft_args, _ = draft
            kv_heads = draft_args.n_kv_heads // (info.world_size if config.mode == "tp" else 1)
            dtype = next(draft_model.parameters()).dtype
            share = PoolShare(block_bytes_of(draft_args, config, kv_heads, dtype) if config.draft_ckpt_dir else 0,
                              sum(t.numel() * t.element_size() for t in [*draft_model.parameters(), *draft_model.buffers()]))
        runner = ModelRunner(model, config, info, args, tokenizer.n_words, prepared, share, adapters=True)
        draft_runner = None
        if draft is not None:
            settings, draft_model, draft_args, draft_prepared = draft
            shared = PoolShare(caches_of=model) if not config.draft_ckpt_dir else PoolShare(n_blocks=runner.cache.n_blocks)
            draft_runner = ModelRunner(draft_model, settings, info, draft_args, tokenizer.n_words, draft_prepared,
                                       shared)
        load_s = time.perf_counter() - started
        log(f"loaded in {load_s:.2f} s ({runner.dtype}, up to {config.max_batch_size} sequences "
            f"of {config.max_seq_len})", info.rank)
        return cls(config, runner, tokenizer, args, info, load_s, draft_runner, lora=runner.adapters)

    @property
    def model(self) -> nn.Module:
        return self.runner.model

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    @property
    def decode_step(self) -> DecodeStep | None:
        return self.runner.decode_step

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
        return self.runner.dtype

    def expert_tokens(self) -> dict[tuple[int, int], int]:
        """Llama 4: the tokens routed to each (layer, expert) since load, on this rank ({} for a dense model)."""
        layers = [(i, layer.feed_forward.tokens_per_expert) for i, layer in enumerate(self.runner.model.layers)
                  if hasattr(layer.feed_forward, "tokens_per_expert")]
        if not layers:
            return {}
        totals = torch.stack([routed for _, routed in layers]).tolist()  # one read of the device, not one a layer
        return {(i, e): n for (i, _), row in zip(layers, totals) for e, n in enumerate(row)}

    def new_scheduler(self) -> Scheduler:
        c = self.config
        pool = BlockPool(self.cache.n_blocks, c.kv_block_size, c.prefix_caching)
        speculator = None
        if c.speculative != "off":
            drafter = None
            if self.draft is not None:
                drafter = Drafter(self._draft_forward, self.tokenizer.n_words, self.tokenizer.stop_ids,
                                  c.prefill_budget, c.kv_block_size, shares_cache=not c.draft_ckpt_dir)
            speculator = Speculator(c.speculative_tokens, c.ngram_min, c.ngram_max, draft=drafter)
        return Scheduler(c.max_batch_size, c.max_seq_len, c.prefill_budget, self.tokenizer.stop_ids, pool, speculator,
                         self.lora.refs if self.lora is not None else None)

    def make_resident(self, name: str, busy: set[str]) -> AdapterRef:
        """Rank 0: adapter `name` (of the catalog) in a slot, loaded there on every rank in a control step where
        it is not yet, in place of the least recently used adapter no sequence of `busy` runs on. ValueError
        where it cannot be read (the slot left empty) or every slot is busy."""
        if self.lora is None or name not in self.catalog:
            raise ValueError(f"unknown LoRA adapter {name!r}; this engine has {sorted(self.catalog) or 'none'}")
        retired = self.lora.retired(name)  # unloaded, then named again: its files are read again
        slot = self.lora.pick_slot(name, busy)
        if slot is None and retired:
            raise ValueError(f"requests still run on the unloaded LoRA adapter {name!r}, whose slots hold its old "
                             "weights; retry when they finish")
        if slot is None:
            raise ValueError(f"all {self.config.max_loras} LoRA adapter slots (handler.max_loras) hold adapters "
                             "that running requests use; retry when one finishes")
        if name not in self.lora.refs or retired:
            self._forward(StepPlan([], end=False, load=slot), (name, self.catalog[name]))
        return self.lora.refs[name]

    def step(self, scheduler: Scheduler, end: bool = False) -> list[Sequence]:
        """Rank 0: one step (the scheduler's plan run on every rank, its tokens picked and committed); the
        sequences it touched. `end`: the plan hands the other ranks back to their callers after it."""
        step_started = time.perf_counter()
        scheduled = scheduler.schedule()
        picked, logprobs, scores, verified = self._forward_and_pick(scheduled, end)
        self._last_step_s = time.perf_counter() - step_started
        accepted, forced = sum(map(len, verified.values())), sum(scheduled.forced)
        self.stats.proposed += sum(row.proposed for row in scheduled.rows) - forced
        self.stats.accepted += accepted - forced
        self.stats.forced += forced
        if scheduler.speculator is not None and scheduled.rows and not scheduled.prompt_tokens:
            scheduler.speculator.observe(len(scheduled.rows) + accepted, self._last_step_s)
        touched = scheduler.commit(scheduled, picked, logprobs, scores, verified)
        for seq in touched:
            if seq.constraint is not None and seq.constraint.failed:
                scheduler.cancel(seq, "error")
        return touched

    def run(self, scheduler: Scheduler, budget_s: float = math.inf, until_finished: bool = False,
            on_step: Callable[[list[Sequence]], bool | None] | None = None) -> None:
        """Rank 0: steps until the scheduler has no work left, until one more step would pass
        `budget_s`, (until_finished) until a sequence finishes, or until `on_step` returns True; the
        other ranks follow.

        The last plan sent has `end` set, so no other rank is left waiting for a plan.
        """
        started = time.perf_counter()
        while True:
            # The last step unless one more would still end within the budget (a step takes about as
            # long as the one before).
            end = time.perf_counter() - started + 2 * self._last_step_s > budget_s
            touched = self.step(scheduler, end)
            if on_step is not None and on_step(touched) and not end:
                self.release()
                return
            if end:
                return
            if not scheduler.has_work() or (until_finished and any(seq.finished for seq in touched)):
                self.release()
                return

    def release(self) -> None:
        """Rank 0: hand the other ranks back to their callers (a step of no rows, with `end`)."""
        self._forward(StepPlan([], end=True))

    def follow(self) -> None:
        """Ranks > 0: run rank 0's plans until one hands control back."""
        while not self._forward(None)[0].end:
            pass

    def _forward(self, plan: StepPlan | None, adapter: tuple[str, object] | None = None
                 ) -> tuple[StepPlan, torch.Tensor | None, list]:
        """A plan sent from rank 0 to every rank (the others pass None) and run by the model it names; a control
        plan (`load`) writes rank 0's `adapter` (name, files) into its slot instead."""
        plan = self.runner.exchange(plan)
        if plan.load >= 0:
            self._load_adapter(plan.load, object_from_rank0(adapter))
            return plan, None, []
        return (self.draft if plan.draft else self.runner).execute(plan)

    def _load_adapter(self, slot: int, adapter: tuple[str, object]) -> None:
        """Every rank reads the adapter into `slot`; where any rank failed every rank empties the slot and rank 0
        raises (ValueError, the cause), while the others go on following."""
        error = None
        try:
            self.lora.load(slot, *adapter)
        except Exception as exc:  # a broken file fails this load only, never the worker group
            error = exc
        if smallest_across_ranks(0 if error else 1, self.device) == 0:
            self.lora.load_empty(slot)
            if self.rank == 0:
                raise ValueError(str(error) if error else f"another rank could not read LoRA adapter {adapter[0]!r}")

    def _draft_forward(self, rows: list[Row]) -> torch.Tensor:
        """Rank 0: draft rows run on every rank; their sampling rows' logits."""
        return self._forward(StepPlan(rows, end=False, draft=True))[1]

    def generate(self, sequences: list[Sequence],
                 on_step: Callable[[list[Sequence]], None] | None = None) -> list[Sequence]:
        """Schedule sequences to their end (every rank calls it; only rank 0's list matters)."""
        if self.rank != 0:
            self.follow()
            return sequences
        scheduler = self.new_scheduler()
        try:
            busy = {seq.adapter for seq in sequences if seq.adapter is not None}
            for name in sorted(busy):
                self.make_resident(name, busy)
            for seq in sequences:
                scheduler.add(seq)
        except ValueError:
            self.release()  # the other ranks are waiting for a plan: let them go
            raise
        self.run(scheduler, on_step=on_step)
        return sequences

    def _forward_and_pick(self, scheduled: Scheduled, end: bool) -> tuple[list[int], list, list, dict[int, list]]:
        """Rank 0's step: the plan out to every rank, the forward, one token picked per sampling row
        (with its log-probabilities where the sequence asks), each row's prompt log-probabilities, and
        the proposals each row that carried some accepted (engine/verify.py)."""
        started = time.perf_counter()
        sampling = [seq for group in scheduled.pickers for seq in group]
        masks = self._start_masks(scheduled, sampling) if any(seq.constraint for seq in sampling) else None
        _, logits, scores = self._forward(StepPlan(scheduled.rows, end))
        if logits is not None and logits.shape[-1] > self.tokenizer.n_words:
            # An embedding padded past the tokenizer: its extra rows were never trained and no id past
            # the tokenizer's can be decoded, so none is picked.
            logits = logits[:, : self.tokenizer.n_words].contiguous()
        picked, logprobs, verified = [], [], {}
        if logits is not None:
            picked, logprobs, verified = verify_rows(logits, scheduled.rows, scheduled.pickers,
                                                     masks.result() if masks is not None else None, scheduled.forced)
            self._advance_constraints(scheduled, picked, verified)
        seconds = time.perf_counter() - started
        if scheduled.prompt_tokens:
            self.stats.prefill_tokens += scheduled.prompt_tokens
            self.stats.prefill_s += seconds
        elif scheduled.rows:
            self.stats.decode_tokens += len(scheduled.rows)
            self.stats.decode_s += seconds
        return picked, logprobs, scores, verified

    def _start_masks(self, scheduled: Scheduled, sampling: list[Sequence]):
        """The grammar masks of the step's constrained pickers at each position they draw at (after their
        forced tokens), computed while the forward runs."""
        if self._masks is None:
            from tp_llama.engine.constraint import Masks  # llguidance only where a grammar is used

            self._masks = Masks()
        rows = [(row, forced) for row, forced in zip(scheduled.rows, scheduled.forced) if row.sample]
        drawn = [row.tokens[len(row.tokens) - row.proposed + forced :]  # its proposals past the forced ones
                 for (row, forced), group in zip(rows, scheduled.pickers) for _ in group]
        return self._masks.start({s: (seq.constraint, drawn[s]) for s, seq in enumerate(sampling) if seq.constraint},
                                 self.tokenizer.n_words)

    def _advance_constraints(self, scheduled: Scheduled, picked: list[int], verified: dict[int, list]) -> None:
        """Each constrained row's grammar takes the proposals it accepted past its forced ones (which it
        took when they were planned) and its picked token; a grammar that fails (a limit hit while
        computing its mask) ends its sequence, logged, as "error"."""
        groups, picks = iter(scheduled.pickers), iter(picked)
        for r, row in enumerate(scheduled.rows):
            for seq, token in zip(next(groups) if row.sample else [], picks):
                if seq.constraint is None or seq.finished:
                    continue
                tokens = row.tokens[1 + scheduled.forced[r] : 1 + len(verified.get(r, ()))] + [token]
                if token in self.tokenizer.stop_ids:
                    tokens.pop()
                if tokens and not seq.constraint.advance(tokens):
                    log(f"sequence {seq.id}: its grammar failed: {seq.constraint.error}", self.rank)
