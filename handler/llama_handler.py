"""TorchServe handler: continuous batching of Llama completions over tensor-parallel ranks.

TorchServe (continuousBatching: true) calls the handler again and again with every request still
in progress plus new ones, and sends each call to every rank. One call is one engine step:
rank 0 admits the new requests, notices the ones whose client left (they are simply absent from
the call), plans the step, and every rank runs it; then rank 0 answers each request with its new
chunk, marked `ts_stream_next: true` until the request's last reply. The other ranks never look
at requests at all, so they cannot disagree with rank 0 about them.

Two front doors share the scheduler: the native API (POST /predictions/NAME, llama_request)
and the OpenAI-compatible one (POST /predictions/NAME/VERSION/v1/..., openai_api), told apart
by the `url_path` header TorchServe sets. Rank 0 also emits the serving metrics (llama_metrics).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

from llama_metrics import ServingMetrics
from llama_request import Live, RequestError, parse_request
from llama_settings import HandlerSettings, resolve_ckpt_dir, settings_from_yaml
from llama_stream import StreamDecoder
from openai_api import MODELS, PATHS, SSE_TYPE, error_body, models_list, parse_openai
import torch
from ts.torch_handler.base_handler import BaseHandler

from tp_llama.distributed import exit_now
from tp_llama.engine import Engine
from tp_llama.scheduler import SamplingParams, Scheduler, Sequence, StepPlan

logger = logging.getLogger(__name__)

JSON_TYPE = "application/json"
NDJSON_TYPE = "application/x-ndjson"
STATUS_PHRASES = {400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}


def _line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


def _stop_worker(rank: int, error: BaseException) -> NoReturn:
    """End this rank's process after a failure mid-step.

    The other ranks are waiting in a collective this rank will never join. Exiting closes its
    connections, so they fail at once instead of at the collective timeout, and TorchServe
    answers the requests in flight with an error and restarts the whole worker: the only way
    back to ranks that are in step.
    """
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
        self._last_step_s = 0.0
        self.model_name = "llama"
        self.metrics: ServingMetrics | None = None

    def initialize(self, context: Any) -> None:
        """Read the yaml handler block and load the checkpoint on this rank (joins the process group)."""
        yaml_config = context.model_yaml_config or {}
        self.settings = settings_from_yaml(yaml_config.get("handler"))
        self.response_timeout_s = float(yaml_config.get("responseTimeout", float("inf")))
        ckpt_dir = resolve_ckpt_dir(self.settings.ckpt_dir, context.system_properties["model_dir"])
        started = time.perf_counter()
        self.engine = Engine.load(
            ckpt_dir,
            mode=self.settings.mode,
            dtype=self.settings.dtype,
            max_seq_len=self.settings.max_seq_len,
            max_batch_size=self.settings.max_batch_size,
            prefill_budget=self.settings.prefill_budget,
        )
        # One token end to end now, so the first client does not pay for lazy kernel/collective setup.
        warm_up = Sequence("warm-up", self.engine.tokenizer.encode("Hello", bos=True), SamplingParams(1))
        self.engine.generate([warm_up])
        if self.engine.rank == 0:
            self.scheduler = self.engine.new_scheduler()
            self.model_name = getattr(context, "model_name", None) or self.model_name
            self.metrics = ServingMetrics(getattr(context, "metrics", None), self.model_name,
                                          self.engine.max_batch_size)
        logger.info(
            "rank %d/%d ready on %s (%d threads): %s (%s tokenizer, mode=%s, %s, %d slots) loaded in %.2f s",
            self.engine.rank,
            self.engine.world_size,
            self.engine.device,
            torch.get_num_threads(),
            ckpt_dir,
            self.engine.tokenizer.family,
            self.settings.mode,
            self.engine.dtype,
            self.engine.max_batch_size,
            time.perf_counter() - started,
        )
        self.initialized = True

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        """One call of the continuous batch: admit, cancel, run steps, one reply per request."""
        self.context = context
        if self.engine.rank != 0:
            try:
                self.engine.follow()
            except Exception as exc:
                _stop_worker(self.engine.rank, exc)
            return [""] * len(data)
        ids = [context.request_ids[idx] for idx in range(len(data))]
        answered_before = {rid for rid in ids if rid in self.live}
        self._cancel_absent(set(ids))
        answers = self._admit(data, ids)
        self._expire()
        try:
            shown = self._run_steps()
        except Exception as exc:
            _stop_worker(self.engine.rank, exc)
        replies = [self._reply(idx, rid, answers.get(rid), shown.get(rid, "")) for idx, rid in enumerate(ids)]
        context.stopping_criteria = [self._stop_flag(rid, rid in answered_before) for rid in ids]
        self._update_metrics()
        return replies

    def _run_steps(self) -> dict[str, str]:
        """One step, or decode steps for up to handler.decode_call_ms while every sequence is only decoding.

        Each call costs a round trip through TorchServe (a few ms on CPU); several decode steps per
        call spread it. A call ends early when a sequence finishes, so its answer goes out at once,
        and holds a single step while a prompt is waiting or prefilling, so that it starts soon.
        """
        scheduler = self.scheduler
        started = time.perf_counter()
        budget_s = 0.0 if scheduler.waiting or any(s.prefilling for s in scheduler.running.values()) else (
            self.settings.decode_call_ms / 1000)
        shown: dict[str, str] = {}
        while True:
            step_started = time.perf_counter()
            plan = scheduler.plan()
            # The last step unless one more would still end within the budget (a step takes about as
            # long as the one before).
            plan.end = step_started - started + 2 * self._last_step_s > budget_s
            _, picked = self.engine.step(plan)
            self._last_step_s = time.perf_counter() - step_started
            touched = scheduler.commit(plan, picked)
            for rid, text in self._after_step().items():
                shown[rid] = shown.get(rid, "") + text
            if plan.end:
                return shown
            if not scheduler.has_work() or any(seq.finished for seq in touched):
                self.engine.step(StepPlan([], end=True))
                return shown

    def _after_step(self) -> dict[str, str]:
        """Per live request: first-token times, and for OpenAI requests the newly shown text. A stop
        string ends its sequence here, between steps, through the scheduler."""
        shown: dict[str, str] = {}
        for rid, live in self.live.items():
            seq = live.seq
            if not live.first_token_seen and seq.first_token_at is not None:
                live.first_token_seen = True
                if self.metrics is not None:
                    self.metrics.first_token(seq)
            if live.api is not None:
                shown[rid] = live.api.advance(seq)
                if live.api.stopped:
                    self.scheduler.cancel(seq, "stop")
        return shown

    def _update_metrics(self) -> None:
        if self.metrics is None:
            return
        scheduler = self.scheduler
        decoding = sum(1 for seq in scheduler.running.values() if not seq.prefilling)
        self.metrics.update_gauges(decoding, len(scheduler.waiting), scheduler.busy_slots)
        self.metrics.flush()

    def _count(self, outcome: str, seq: Sequence | None = None) -> None:
        if self.metrics is not None:
            self.metrics.request(outcome)
            if seq is not None:
                self.metrics.ended(seq)

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
            self.scheduler.cancel(live.seq)
            self._log_end(rid, live, "cancelled: the client disconnected")
            self._count("cancelled", live.seq)

    def _url_path(self, idx: int) -> str:
        try:
            path = self.context.get_request_header(idx, "url_path")
        except (AttributeError, IndexError, KeyError, TypeError):
            return ""
        return (path or "").strip("/")

    def _admit(self, data: list[dict[str, Any]], ids: list[str]) -> dict[str, tuple[str, Any]]:
        """Validate the requests seen for the first time; the valid ones join the scheduler's queue.

        Returns the requests answered whole in this call: ("error", RequestError) with the front
        door's error shape ("openai" or "native" in `api`), or ("models", None).
        """
        answers: dict[str, tuple[str, Any]] = {}
        for idx, (request, rid) in enumerate(zip(data, ids)):
            if rid in self.live:
                continue
            path = self._url_path(idx)
            openai = path.startswith("v1/") or path == "v1"
            try:
                if path == MODELS:
                    answers[rid] = ("models", None)
                    continue
                if not request:
                    raise RequestError("internal error: the worker lost this request's state", 500)
                if openai:
                    if path not in PATHS:
                        raise RequestError(f"unknown path {path!r}: this server has /{MODELS} (GET) and "
                                           f"POST /{' and /'.join(PATHS)}", 404)
                    api = parse_openai(path, request, self.settings, self.engine.tokenizer,
                                       self.engine.tokenizer.n_words, self.model_name, rid)
                    job = api.job
                elif path:
                    raise RequestError(f"unknown path {path!r}: POST /predictions/NAME for the native API, "
                                       "or /predictions/NAME/VERSION/v1/completions (or chat/completions)", 404)
                else:
                    api, job = None, parse_request(request, self.settings, self.engine.tokenizer)
                seq = Sequence(rid, job.prompt_ids, SamplingParams(
                    job.max_new_tokens, job.temperature, job.top_p, job.seed, job.ignore_eos))
                self.scheduler.add(seq)
            except RequestError as exc:
                answers[rid] = ("openai" if openai else "native", exc)
                continue
            except Exception as exc:  # a bug must fail this request only, never the step
                logger.exception("unexpected error while reading a request")
                error = RequestError(f"internal error while reading the request: {type(exc).__name__}", 500)
                answers[rid] = ("openai" if openai else "native", error)
                continue
            if api is not None:
                api.start(self.engine.tokenizer.decode)
                stream = None
            else:
                stream = StreamDecoder(self.engine.tokenizer.decode) if job.stream else None
            self.live[rid] = Live(job, seq, stream, api)
        return answers

    def _expire(self) -> None:
        """Requests older than the yaml's responseTimeout end now, with what they have."""
        now = time.perf_counter()
        for live in self.live.values():
            if now - live.seq.arrived > self.response_timeout_s:
                self.scheduler.cancel(live.seq, "timeout")

    def _reply(self, idx: int, rid: str, answer: tuple[str, Any] | None, shown: str) -> str:
        context = self.context
        if answer is not None:
            kind, error = answer
            context.set_response_content_type(idx, JSON_TYPE)
            if kind == "models":
                return _line(models_list(self.model_name))
            context.set_response_status(error.status, STATUS_PHRASES.get(error.status, "Error"), idx)
            self._count("4xx" if error.status < 500 else "failed")
            return _line(error_body(error) if kind == "openai" else {"error": str(error)})
        live = self.live[rid]
        seq = live.seq
        if live.api is not None:
            return self._openai_reply(idx, rid, live, shown)
        context.set_response_content_type(idx, NDJSON_TYPE if live.stream else JSON_TYPE)
        if not seq.finished:
            if live.stream is None:
                return ""
            new = seq.take_new_tokens()
            return _line({"text": live.stream.push(new), "token_ids": new}) if new else ""
        self._retire(rid, live, seq.finish_reason)
        usage = {"prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.output)}
        if seq.finish_reason == "timeout":
            return _line({"error": f"the request ran past responseTimeout ({self.response_timeout_s:g} s)",
                          "finish_reason": "timeout", "usage": usage})
        if live.stream is None:
            return _line({"text": self.engine.tokenizer.decode(seq.output), "token_ids": seq.output,
                          "finish_reason": seq.finish_reason, "usage": usage})
        new = seq.take_new_tokens()
        text = live.stream.push(new) + live.stream.finish()
        return _line({"text": text, "token_ids": new, "finish_reason": seq.finish_reason,
                      "usage": usage})

    def _openai_reply(self, idx: int, rid: str, live: Live, shown: str) -> str:
        api, seq = live.api, live.seq
        self.context.set_response_content_type(idx, SSE_TYPE if api.job.stream else JSON_TYPE)
        if api.job.stream:
            reply = api.stream_reply(shown, seq)
        elif seq.finished:
            reply = _line(api.final_reply(seq, self.engine.tokenizer.decode))
        else:
            reply = ""
        if seq.finished:
            self._retire(rid, live, "stop (a stop string)" if api.stopped else seq.finish_reason)
        return reply

    def _retire(self, rid: str, live: Live, how: str) -> None:
        """A request's last reply is written: forget it, log and count how it ended."""
        del self.live[rid]
        self._log_end(rid, live, how)
        self._count("failed" if live.seq.finish_reason == "timeout" else "ok", live.seq)

    def _log_end(self, rid: str, live: Live, how: str) -> None:
        logger.info(
            "rank 0: request %s %s after %d tokens; kv slots busy %d/%d, waiting %d",
            rid, how, len(live.seq.output), self.scheduler.busy_slots, self.engine.max_batch_size,
            len(self.scheduler.waiting),
        )
