"""TorchServe handler: continuous batching of Llama completions over tensor-parallel ranks.

TorchServe (continuousBatching: true) calls the handler again and again with every request still
in progress plus new ones, and sends each call to every rank. One call is one engine step:
rank 0 admits the new requests, notices the ones whose client left (they are simply absent from
the call), plans the step, and every rank runs it; then rank 0 answers each request with its new
chunk, marked `ts_stream_next: true` until the request's last reply. The other ranks never look
at requests at all, so they cannot disagree with rank 0 about them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

from llama_request import Live, RequestError, parse_request
from llama_settings import HandlerSettings, resolve_ckpt_dir, settings_from_yaml
from llama_stream import StreamDecoder
from ts.torch_handler.base_handler import BaseHandler

from tp_llama.distributed import exit_now
from tp_llama.engine import Engine
from tp_llama.scheduler import SamplingParams, Scheduler, Sequence

logger = logging.getLogger(__name__)

JSON_TYPE = "application/json"
NDJSON_TYPE = "application/x-ndjson"
STATUS_PHRASES = {400: "Bad Request", 500: "Internal Server Error"}


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
    """Loads the engine on every rank; rank 0 schedules, every rank runs one step per call."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.settings: HandlerSettings | None = None
        self.scheduler: Scheduler | None = None
        self.live: dict[str, Live] = {}
        self.response_timeout_s = float("inf")

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
        logger.info(
            "rank %d/%d ready on %s: %s (%s tokenizer, mode=%s, %s, %d slots) loaded in %.2f s",
            self.engine.rank,
            self.engine.world_size,
            self.engine.device,
            ckpt_dir,
            self.engine.tokenizer.family,
            self.settings.mode,
            self.engine.dtype,
            self.engine.max_batch_size,
            time.perf_counter() - started,
        )
        self.initialized = True

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        """One call of the continuous batch: admit, cancel, one step, one reply per request."""
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
        errors = self._admit(data, ids)
        self._expire()
        try:
            plan = self.scheduler.plan()
            _, picked = self.engine.step(plan)
            self.scheduler.commit(plan, picked)
        except Exception as exc:
            _stop_worker(self.engine.rank, exc)
        replies = [self._reply(idx, rid, errors.get(rid)) for idx, rid in enumerate(ids)]
        context.stopping_criteria = [self._stop_flag(rid, rid in answered_before) for rid in ids]
        return replies

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

    def _admit(self, data: list[dict[str, Any]], ids: list[str]) -> dict[str, RequestError]:
        """Validate the requests seen for the first time; the valid ones join the scheduler's queue."""
        errors: dict[str, RequestError] = {}
        for request, rid in zip(data, ids):
            if rid in self.live:
                continue
            try:
                if not request:
                    raise RequestError("internal error: the worker lost this request's state", 500)
                job = parse_request(request, self.settings, self.engine.tokenizer)
                seq = Sequence(rid, job.prompt_ids, SamplingParams(
                    job.max_new_tokens, job.temperature, job.top_p, job.seed, job.ignore_eos))
                self.scheduler.add(seq)
            except RequestError as exc:
                errors[rid] = exc
                continue
            except Exception as exc:  # a bug must fail this request only, never the step
                logger.exception("unexpected error while reading a request")
                errors[rid] = RequestError(f"internal error while reading the request: {type(exc).__name__}", 500)
                continue
            stream = StreamDecoder(self.engine.tokenizer.decode) if job.stream else None
            self.live[rid] = Live(job, seq, stream)
        return errors

    def _expire(self) -> None:
        """Requests older than the yaml's responseTimeout end now, with what they have."""
        now = time.perf_counter()
        for live in self.live.values():
            if not live.seq.finished and now - live.seq.arrived > self.response_timeout_s:
                self.scheduler.cancel(live.seq)
                live.seq.finish_reason = "timeout"

    def _reply(self, idx: int, rid: str, error: RequestError | None) -> str:
        context = self.context
        if error is not None:
            context.set_response_status(error.status, STATUS_PHRASES[error.status], idx)
            context.set_response_content_type(idx, JSON_TYPE)
            return _line({"error": str(error)})
        live = self.live[rid]
        seq = live.seq
        context.set_response_content_type(idx, NDJSON_TYPE if live.stream else JSON_TYPE)
        if not seq.finished:
            if live.stream is None:
                return ""
            new = seq.take_new_tokens()
            return _line({"text": live.stream.push(new), "token_ids": new}) if new else ""
        del self.live[rid]
        self._log_end(rid, live, seq.finish_reason)
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

    def _log_end(self, rid: str, live: Live, how: str) -> None:
        logger.info(
            "rank 0: request %s %s after %d tokens; kv slots busy %d/%d, waiting %d",
            rid, how, len(live.seq.output), self.scheduler.busy_slots, self.engine.max_batch_size,
            len(self.scheduler.waiting),
        )
