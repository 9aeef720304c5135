"""TorchServe handler: continuous batching of Llama completions over tensor-parallel ranks.

TorchServe (continuousBatching: true) calls the handler again and again with every request still
in progress plus new ones, and sends each call to every rank. Rank 0 admits the new requests,
notices the ones whose client left (they are simply absent from the call), runs the engine's
steps (tp_llama.engine.core.Engine.run) while the other ranks follow its plans, then answers
each request with its new chunk, marked `ts_stream_next: true` until the request's last reply.
The other ranks never look at requests at all, so they cannot disagree with rank 0 about them.

Every rank loads and steps on one thread of its own (tp_llama.serving.step_thread). With
handler.step_between_calls it goes on stepping after a call has answered, while TorchServe carries the
replies out and the next call in, which ends those steps (after the one in progress) and sends their tokens.

Two front doors share the scheduler: the native API (POST /predictions/NAME,
tp_llama.serving.native) and the OpenAI-compatible one (POST /predictions/NAME/VERSION/v1/...,
tp_llama.serving.openai_api), told apart by the `url_path` header TorchServe sets. Rank 0 also
emits the serving metrics (tp_llama.serving.metrics).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn

import torch
from ts.torch_handler.base_handler import BaseHandler

from tp_llama.engine.constraint import grammar_tokenizer
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Scheduler, Sequence
from tp_llama.parallel.distributed import exit_now
from tp_llama.serving.grammars import COMPILE_LIMIT_S, GrammarCompiler, Pending
from tp_llama.serving.lora_admin import ADMIN_HEADER, admin_request, with_catalog
from tp_llama.serving.lora_admin import PATHS as ADMIN_PATHS
from tp_llama.serving.metrics import ServingMetrics
from tp_llama.serving.openai_api import error_body
from tp_llama.serving.request import Live, RequestError, json_line, request_of
from tp_llama.serving.routes import answer_now, open_request, openai_shaped, repeats
from tp_llama.serving.settings import (HandlerSettings, check_model_config, device_of, resolve_adapters,
                                       resolve_ckpt_dir)
from tp_llama.serving.step_thread import StepThread
from tp_llama.serving.threads import choose_threads
from tp_llama.serving.tool_use import resolve_tool_format

logger = logging.getLogger(__name__)

STATUS_PHRASES = {400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}


def _stop_worker(rank: int, error: BaseException) -> NoReturn:
    """End this rank's process after a failure mid-step: the other ranks wait in a collective it will never
    join, and exiting closes its connections, so they fail at once instead of at the collective timeout, and
    TorchServe answers the requests in flight with an error and restarts the whole worker (ranks in step again)."""
    logger.critical("rank %d: step failed; stopping the worker so TorchServe restarts it", rank, exc_info=error)
    for log_handler in logging.getLogger().handlers:
        log_handler.flush()
    exit_now(1)


class LlamaHandler(BaseHandler):
    """Loads the engine on every rank; rank 0 schedules, every rank runs the steps of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.settings: HandlerSettings | None = None
        self.scheduler: Scheduler | None = None
        self.live: dict[str, Live] = {}
        self.response_timeout_s = float("inf")
        self.model_name = "llama"
        self.metrics: ServingMetrics | None = None
        self.grammars: GrammarCompiler | None = None
        self.compiling: dict[str, tuple[Pending, str]] = {}  # request id -> its grammar, its front door
        self.steps: StepThread | None = None
        self._between_s = 0.0  # how long the steps run since the last call took (0: none ran)
        self._first_tokens: list[Sequence] = []  # first tokens not yet in the metrics

    def initialize(self, context: Any) -> None:
        """Read the yaml handler block and load the checkpoint on this rank (joins the process group)."""
        yaml_config = context.model_yaml_config or {}
        settings = check_model_config(yaml_config)
        self.response_timeout_s = float(yaml_config.get("responseTimeout", float("inf")))
        model_dir = context.system_properties["model_dir"]
        draft = settings.engine.draft_ckpt_dir
        engine = replace(settings.engine, ckpt_dir=resolve_ckpt_dir(settings.engine.ckpt_dir, model_dir),
                         draft_ckpt_dir=resolve_ckpt_dir(draft, model_dir, "draft_ckpt_dir") if draft else None,
                         lora_adapters=resolve_adapters(settings.engine.lora_adapters, model_dir),
                         lora_folder=(resolve_ckpt_dir(settings.engine.lora_folder, model_dir, "lora_folder",
                                                       "adapters, one folder each") if settings.engine.lora_folder
                                      else None),
                         device=device_of(yaml_config.get("deviceType")))
        self.settings = settings = replace(settings, engine=engine)
        if engine.device == "cpu" or (engine.device == "auto" and not torch.cuda.is_available()):
            # TorchServe's OMP_NUM_THREADS is 1 unless the yaml says: unset, the ranks share the usable cores.
            threads = choose_threads(yaml_config.get("torchrun"))
            torch.set_num_threads(threads.threads)
            logger.info("rank %s: %s", os.environ.get("RANK", "0"), threads.log_line())
        started = time.perf_counter()
        self.steps = StepThread()
        self.engine = self.steps.run(Engine.load, settings.engine)
        self.settings = settings = replace(settings, tool_format=resolve_tool_format(
            settings.tool_format, self.engine.tokenizer.family, self.engine.args.dim))
        # One token end to end now, so the first client does not pay for lazy kernel/collective setup.
        warm_up = Sequence("warm-up", self.engine.tokenizer.encode("Hello", bos=True), SamplingParams(1))
        self.steps.run(self.engine.generate, [warm_up])
        # The worker serves this model for its life: frozen, its objects are no longer walked by the
        # cyclic collector whenever a step's garbage starts it (a profile of bench/engine/step.py shows it).
        gc.collect()
        gc.freeze()
        if self.engine.rank == 0:
            self.scheduler = self.engine.new_scheduler()
            self.model_name = getattr(context, "model_name", None) or self.model_name
            self.metrics = ServingMetrics(getattr(context, "metrics", None), self.model_name,
                                          self.scheduler.pool.n_blocks, self.scheduler.speculator is not None)
            self.grammars = GrammarCompiler(grammar_tokenizer(self.engine.tokenizer))
        logger.info(
            "rank %d/%d ready on %s (%d threads): %s (%s tokenizer, mode=%s, %s, up to %d sequences) loaded in %.2f s",
            self.engine.rank, self.engine.world_size, self.engine.device, torch.get_num_threads(), engine.ckpt_dir,
            self.engine.tokenizer.family, settings.engine.mode, self.engine.dtype, settings.engine.max_batch_size,
            time.perf_counter() - started,
        )
        self.initialized = True

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        """One call of the continuous batch: admit, cancel, run steps, one reply per request."""
        self.context = context
        self.steps.end_between_calls()  # rank 0 asks them to end; the other ranks follow its plans
        if self.engine.rank != 0:
            self.steps.run(self._guarded, self.engine.follow)
            if self.settings.step_between_calls:
                self.steps.start_between_calls(self._guarded, self.engine.follow)
            return [""] * len(data)
        ids = [context.request_ids[idx] for idx in range(len(data))]
        answered_before = {rid for rid in ids if rid in self.live}
        self._cancel_absent(set(ids))
        repeated = repeats(ids, self._url_path)  # a 400 each (its flag the id's); the first of each id is served
        answers = self._admit(data, ids)
        self._settle_grammars(answers)
        self._expire()
        # A grammar still compiling is answered in this call (a refusal must be a 400): the running
        # sequences go on stepping meanwhile, and the call ends once every grammar is settled. The steps
        # run since the last call count toward this one's budget: where they spent it (or ended a
        # sequence) the call answers at once, so their tokens never wait behind one more step.
        budget, between_s = self._call_budget_s(), self._between_s
        self._between_s = 0.0
        if self.compiling or not between_s or (budget > between_s and not any(v.finished for v in self.live.values())):
            self.steps.run(self._guarded, self.engine.run, self.scheduler,
                           COMPILE_LIMIT_S if self.compiling else budget - between_s, not self.compiling, self._after_step)
        self._settle_grammars(answers, wait=True)
        replies = [self._reply(idx, rid, repeated.get(idx) or answers.get(rid)) for idx, rid in enumerate(ids)]
        context.stopping_criteria = [self._stop_flag(rid, rid in answered_before) for rid in ids]
        self._update_metrics()
        if self.settings.step_between_calls:
            self.steps.start_between_calls(self._guarded, self._step_between_calls)
        return replies

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """fn(*args) on the step thread; a failure stops this rank (_stop_worker)."""
        try:
            fn(*args)
        except Exception as exc:
            _stop_worker(self.engine.rank, exc)

    def _step_between_calls(self) -> None:
        """Rank 0, on the step thread once a call has answered: steps until the next call arrives or
        nothing is left to step (until a grammar this call waits for is settled); the other ranks follow."""
        if not self.scheduler.has_work():
            self.engine.release()
            return
        started = time.perf_counter()
        self.engine.run(self.scheduler, on_step=lambda touched: self._after_step(touched) or self.steps.call_arrived())
        self._between_s = time.perf_counter() - started

    def _call_budget_s(self) -> float:
        """How long this call may go on stepping: one step while a prompt waits or is prefilled (so it starts
        soon), else handler.decode_call_ms of decode steps, which spread the call's round trip through TorchServe
        (a call still ends as soon as a sequence finishes)."""
        snapshot = self.scheduler.snapshot()
        if snapshot.waiting or snapshot.prefilling:
            return 0.0
        return self.settings.decode_call_ms / 1000

    def _after_step(self, touched: list[Sequence]) -> bool:
        """Per request whose sequences the step touched: its first-token time, and the newly shown text of
        this step. A stop string ends its sequence here, between steps, through the scheduler. True: end
        the call now (the grammars this call waits for are settled)."""
        rids = dict.fromkeys(request_of(seq.id, self.live) for seq in touched)
        for live in (self.live[rid] for rid in rids if rid in self.live):
            if not live.first_token_seen:
                first = next((seq for seq in live.seqs if seq.first_token_at is not None), None)
                if first is not None:
                    live.first_token_seen = True
                    if self.metrics is not None:  # emitted on the main thread, where TorchServe's metrics live
                        self._first_tokens.append(first)
            for seq in live.api.advance():
                self.scheduler.cancel(seq, "stop")
        return bool(self.compiling) and all(pending.ready for pending, _ in self.compiling.values())

    def _settle_grammars(self, answers: dict[str, tuple[str, Any]], wait: bool = False) -> None:
        """Requests whose grammar is compiled join the queue, each sequence with its own matcher; a refused
        grammar is the request's answer (wait: block until every grammar is settled, at most the limit)."""
        for rid, (pending, door) in list(self.compiling.items()):
            if wait and not pending.ready:
                try:
                    pending.future.result(timeout=max(0.0, pending.started + COMPILE_LIMIT_S - time.perf_counter()))
                except Exception:  # a refusal is read below, as pending.result()
                    pass
            if not pending.ready:
                continue
            del self.compiling[rid]
            live = self.live[rid]
            try:
                constraint = pending.result()
                for i, seq in enumerate(live.seqs):
                    seq.constraint = constraint if i == 0 else constraint.fork()
                if not live.finished:  # else past responseTimeout while compiling: ended, never to be queued
                    self._add(live.seqs)
            except RequestError as exc:
                del self.live[rid]
                answers[rid] = (door, exc)

    def _update_metrics(self) -> None:
        if self.metrics is None:
            return
        for seq in self._first_tokens:
            self.metrics.first_token(seq)
        self._first_tokens.clear()
        snapshot = self.scheduler.snapshot()
        self.metrics.update_gauges(snapshot.decoding, snapshot.waiting, snapshot.blocks_used)
        self.metrics.cache_counts(snapshot.prefix_queries, snapshot.prefix_hits, snapshot.preemptions)
        self.metrics.speculation(snapshot.drafts, snapshot.proposed, snapshot.accepted, list(snapshot.accepted_at))
        self.metrics.experts(self.engine.expert_tokens())
        self.metrics.flush()

    def _count(self, outcome: str, live: Live | None = None) -> None:
        if self.metrics is not None:
            self.metrics.request(outcome)
            for i, seq in enumerate(live.seqs if live is not None else ()):
                self.metrics.ended(seq, prompt=i % live.api.job.n == 0)  # a group's prompt once, as in usage

    def _stop_flag(self, rid: str, answered_before: bool) -> Callable[[str], bool | None]:
        """How TorchServe learns whether a reply is a request's last: it calls this once per reply.

        False keeps the request in the continuous batch (ts_stream_next: true). A request answered
        whole in its first call gets None (no header: an ordinary response with its own status);
        True (ts_stream_next: false) ends a response that earlier calls began.
        """
        if rid in self.live:
            return lambda _reply: False
        return lambda _reply: True if answered_before else None

    def _cancel_absent(self, present: set[str]) -> None:
        """TorchServe drops a job whose client closed its connection: its absence is the signal."""
        for rid in [rid for rid in self.live if rid not in present]:
            live = self.live.pop(rid)
            self.compiling.pop(rid, None)
            for seq in live.seqs:
                self.scheduler.cancel(seq)
            self._log_end(rid, live, "cancelled: the client disconnected")
            self._count("cancelled", live)

    def _url_path(self, idx: int) -> str:
        try:
            path = self.context.get_request_header(idx, "url_path")
        except (AttributeError, IndexError, KeyError, TypeError):
            return ""
        return (path or "").strip("/")

    def _admit(self, data: list[dict[str, Any]], ids: list[str]) -> dict[str, tuple[str, Any]]:
        """Validate the requests seen for the first time; the valid ones join the scheduler's queue.

        Returns the requests answered whole in this call: (the front door's error shape, "openai" or
        "native", RequestError), or ("reply", the JSON reply of a path answered without the engine).
        """
        answers: dict[str, tuple[str, Any]] = {}
        tokenizer = self.engine.tokenizer
        for idx, (request, rid) in enumerate(zip(data, ids)):
            if rid in self.live or rid in answers:  # in progress, or seen earlier in this call
                continue
            path = self._url_path(idx)
            openai = openai_shaped(path)
            try:
                now = answer_now(path, request, self.settings, tokenizer, self.model_name)
                if now is None and path in ADMIN_PATHS:
                    now = self._administer(idx, path, request)
                if now is not None:
                    answers[rid] = ("reply", now)
                    continue
                if not request:  # a form-encoded body: TorchServe makes it form fields, none of them the body
                    raise RequestError("empty request: send a JSON object with Content-Type: application/json")
                api = open_request(path, request, self.settings, tokenizer, self.engine.args.vocab_size,
                                   self.model_name, rid)
                if api.job.adapter is not None:
                    self._resident(api.job.adapter)
                seqs = api.sequences(rid)
                if api.job.grammar is not None:
                    self.compiling[rid] = (self.grammars.submit(api.job.grammar), "openai" if openai else "native")
                else:
                    self._add(seqs)
            except RequestError as exc:
                answers[rid] = ("openai" if openai else "native", exc)
                continue
            except Exception as exc:  # a bug must fail this request only, never the step
                logger.exception("unexpected error while reading a request")
                error = RequestError(f"internal error while reading the request: {type(exc).__name__}", 500)
                answers[rid] = ("openai" if openai else "native", error)
                continue
            self.live[rid] = Live(api, seqs)
        return answers

    def _administer(self, idx: int, path: str, request: dict[str, Any]) -> dict[str, Any]:
        """A load_lora_adapter / unload_lora_adapter request (serving/lora_admin.py): a loaded adapter is read on
        every rank now; an unloaded one is refused to new requests at once, and its slot goes first once the
        requests running on it end."""
        try:
            key = self.context.get_request_header(idx, ADMIN_HEADER)
        except (AttributeError, IndexError, KeyError, TypeError):
            key = None
        name, folder = admin_request(path, request, self.settings, key)
        catalog = self.engine.catalog
        if folder is None:
            del catalog[name]
            self.engine.lora.retire(name)
        else:
            catalog[name] = folder
            try:
                self._resident(name)
            except RequestError:
                del catalog[name]
                raise
        self.settings = with_catalog(self.settings, catalog)
        return {"object": "lora_adapter", "name": name, "status": "unloaded" if folder is None else "loaded"}

    def _resident(self, name: str) -> None:
        """Adapter `name` in a slot on every rank before its request is scheduled; the client's error where it
        cannot be read, or where every slot holds an adapter in use (503: retry later)."""
        busy = {seq.adapter for live in self.live.values() for seq in live.seqs if not seq.finished}
        try:
            self.steps.run(self.engine.make_resident, name, busy)
        except ValueError as exc:
            raise RequestError(str(exc), 503 if "slots" in str(exc) else 400, param="model") from None

    def _add(self, seqs: list[Sequence]) -> None:
        """All of a request's sequences join the queue, or none (the ones added are taken back); the engine's
        own limits (a group larger than the batch or the KV pool) are the client's 400."""
        try:
            for seq in seqs:
                self.scheduler.add(seq)
        except Exception as exc:
            for seq in seqs:
                self.scheduler.cancel(seq)
            if isinstance(exc, ValueError):
                raise RequestError(f"the request cannot be scheduled: {exc}") from None
            raise

    def _expire(self) -> None:
        """Requests older than the yaml's responseTimeout end now, with what they have."""
        now = time.perf_counter()
        for live in self.live.values():
            if now - live.seqs[0].arrived > self.response_timeout_s:
                for seq in live.seqs:
                    self.scheduler.cancel(seq, "timeout")

    def _reply(self, idx: int, rid: str, answer: tuple[str, Any] | None) -> str:
        context = self.context
        if answer is not None:
            kind, value = answer
            context.set_response_content_type(idx, "application/json")
            if kind == "reply":
                return json_line(value)
            error = value
            context.set_response_status(error.status, STATUS_PHRASES.get(error.status, "Error"), idx)
            self._count("4xx" if error.status < 500 else "unavailable" if error.status == 503 else "failed")
            return json_line(error_body(error) if kind == "openai" else {"error": str(error)})
        live = self.live[rid]
        context.set_response_content_type(idx, live.api.content_type)
        reply = live.api.reply(self.response_timeout_s)
        if live.finished:
            self._retire(rid, live, "stop (a stop string)" if live.api.stopped else live.seqs[-1].finish_reason)
        return reply

    def _retire(self, rid: str, live: Live, how: str) -> None:
        """A request's last reply is written: forget it, log and count how it ended."""
        del self.live[rid]
        self._log_end(rid, live, how)
        timed_out = any(seq.finish_reason == "timeout" for seq in live.seqs)
        self._count("failed" if timed_out else "ok", live)

    def _log_end(self, rid: str, live: Live, how: str) -> None:
        logger.info(
            "rank 0: request %s %s after %d tokens; running %d/%d, kv blocks used %d/%d, waiting %d",
            rid, how, sum(len(seq.output) for seq in live.seqs), len(self.scheduler.running), self.engine.config.max_batch_size,
            self.scheduler.pool.used, self.scheduler.pool.n_blocks, len(self.scheduler.waiting),
        )
