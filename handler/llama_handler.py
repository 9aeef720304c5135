"""TorchServe handler serving a Meta Llama checkpoint with tensor parallelism.

TorchServe starts one torchrun worker with N ranks (parallelType "tp") and sends every batch
to every rank; only rank 0's answer reaches the clients. Each rank therefore validates the
same requests the same way and runs the same single batched generation, so the ranks'
collectives always match, and a bad request in a batch is answered with its own 400.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, NoReturn

from llama_request import Job, RequestError, parse_request
from llama_settings import HandlerSettings, resolve_ckpt_dir, settings_from_yaml
from llama_stream import StreamDecoder
from ts.handler_utils.utils import send_intermediate_predict_response
from ts.torch_handler.base_handler import BaseHandler

from tp_llama.distributed import exit_now
from tp_llama.engine import Engine, GenerationRequest, GenerationResult

logger = logging.getLogger(__name__)

JSON_TYPE = "application/json"
NDJSON_TYPE = "application/x-ndjson"
STATUS_PHRASES = {400: "Bad Request", 500: "Internal Server Error"}


def _line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


def _usage(job: Job, result: GenerationResult) -> dict[str, int]:
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": len(result.token_ids)}


def _stop_worker(rank: int, error: Exception) -> NoReturn:
    """End this rank's process after a failure mid-batch.

    The other ranks are waiting in a collective this rank will never join. Exiting closes its
    connections, so they fail at once instead of at the collective timeout, and TorchServe
    answers the batch with an error and restarts the whole worker: the only way back to ranks
    that are in step.
    """
    logger.critical("rank %d: generation failed; stopping the worker so TorchServe restarts it", rank, exc_info=error)
    for log_handler in logging.getLogger().handlers:
        log_handler.flush()
    exit_now(1)


class LlamaHandler(BaseHandler):
    """Loads the engine on every rank and answers batches of completion/chat requests."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.settings: HandlerSettings | None = None
        self._streams: dict[int, StreamDecoder] = {}

    def initialize(self, context: Any) -> None:
        """Read the yaml handler block and load the checkpoint on this rank (joins the process group)."""
        self.settings = settings_from_yaml((context.model_yaml_config or {}).get("handler"))
        ckpt_dir = resolve_ckpt_dir(self.settings.ckpt_dir, context.system_properties["model_dir"])
        started = time.perf_counter()
        self.engine = Engine.load(
            ckpt_dir,
            mode=self.settings.mode,
            dtype=self.settings.dtype,
            max_seq_len=self.settings.max_seq_len,
            max_batch_size=self.settings.max_batch_size,
        )
        # One token end to end now, so the first client does not pay for lazy kernel/collective setup.
        self.engine.generate([GenerationRequest(self.engine.tokenizer.encode("Hello", bos=True), 1)])
        logger.info(
            "rank %d/%d ready on %s: %s (%s tokenizer, mode=%s) loaded in %.2f s",
            self.engine.rank,
            self.engine.world_size,
            self.engine.device,
            ckpt_dir,
            self.engine.tokenizer.family,
            self.settings.mode,
            time.perf_counter() - started,
        )
        self.initialized = True

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        """One TorchServe batch: validate each request, generate the valid ones together, answer each."""
        self.context = context
        started = time.perf_counter()
        jobs = self.preprocess(data)
        try:
            results = self.inference(jobs)
        except Exception as exc:
            _stop_worker(self.engine.rank, exc)
        replies = self.postprocess(jobs, results)
        valid = sum(isinstance(job, Job) for job in jobs)
        logger.info(
            "rank %d: batch of %d requests: %d generated, %d rejected, %d new tokens in %.3f s; kv slots busy %d/%d",
            self.engine.rank,
            len(data),
            valid,
            len(data) - valid,
            sum(len(r.token_ids) for r in results if r is not None),
            time.perf_counter() - started,
            self.engine.busy_slots,
            self.engine.max_batch_size,
        )
        return replies

    def preprocess(self, data: list[dict[str, Any]]) -> list[Job | RequestError]:
        """Parse and validate every request; the same bytes give the same verdict on every rank."""
        jobs: list[Job | RequestError] = []
        for request in data:
            try:
                jobs.append(parse_request(request, self.settings, self.engine.tokenizer))
            except RequestError as exc:
                jobs.append(exc)
            except Exception as exc:  # a bug must fail this request only, not its whole batch
                logger.exception("unexpected error while reading a request")
                jobs.append(RequestError(f"internal error while reading the request: {type(exc).__name__}", 500))
        return jobs

    def inference(self, jobs: list[Job | RequestError]) -> list[GenerationResult | None]:
        """Run every valid job in one engine.generate call, streaming chunks where asked."""
        positions = [idx for idx, job in enumerate(jobs) if isinstance(job, Job)]
        results: list[GenerationResult | None] = [None] * len(jobs)
        self._streams = self._open_streams(jobs, positions)
        if not positions:
            return results
        requests = [
            GenerationRequest(job.prompt_ids, job.max_new_tokens, job.temperature, job.top_p, job.seed, job.ignore_eos)
            for job in (jobs[idx] for idx in positions)
        ]
        streams = self._streams
        on_tokens = (lambda new_ids: self._send_chunks(streams, positions, new_ids)) if streams else None
        for idx, result in zip(positions, self.engine.generate(requests, on_tokens=on_tokens)):
            results[idx] = result
        return results

    def postprocess(self, jobs: list[Job | RequestError], results: list[GenerationResult | None]) -> list[str]:
        """One reply per request: the completion, the last stream chunk, or the error."""
        replies = []
        for idx, (job, result) in enumerate(zip(jobs, results)):
            if isinstance(job, RequestError):
                self.context.set_response_status(job.status, STATUS_PHRASES[job.status], idx)
                self.context.set_response_content_type(idx, JSON_TYPE)
                replies.append(_line({"error": str(job)}))
            elif job.stream:
                stream = self._streams.get(idx)
                text = stream.finish() if stream is not None else self.engine.tokenizer.decode(result.token_ids)
                sent = 0 if stream is None else len(result.token_ids)
                replies.append(
                    _line(
                        {
                            "text": text,
                            "token_ids": result.token_ids[sent:],
                            "finish_reason": result.finish_reason,
                            "usage": _usage(job, result),
                        }
                    )
                )
            else:
                self.context.set_response_content_type(idx, JSON_TYPE)
                replies.append(
                    _line(
                        {
                            "text": self.engine.tokenizer.decode(result.token_ids),
                            "token_ids": result.token_ids,
                            "finish_reason": result.finish_reason,
                            "usage": _usage(job, result),
                        }
                    )
                )
        return replies

    def _open_streams(self, jobs: list[Job | RequestError], positions: list[int]) -> dict[int, StreamDecoder]:
        """Decoders for streaming requests; only rank 0 talks to the frontend, so only it needs them."""
        if self.engine.rank != 0:
            return {}
        streams = {}
        for idx in positions:
            if jobs[idx].stream:
                streams[idx] = StreamDecoder(self.engine.tokenizer.decode)
                self.context.set_response_content_type(idx, NDJSON_TYPE)
        return streams

    def _send_chunks(self, streams: dict[int, StreamDecoder], positions: list[int], new_ids: list[list[int]]) -> None:
        """After each decode step, one intermediate chunk per streaming request that got tokens."""
        chunks: dict[int, str] = {}
        for idx, ids in zip(positions, new_ids):
            if idx in streams and ids:
                chunks[idx] = _line({"text": streams[idx].push(ids), "token_ids": ids})
        if not chunks:
            return
        request_ids = {idx: self.context.request_ids[idx] for idx in chunks}
        try:
            send_intermediate_predict_response(chunks, request_ids, "Intermediate Prediction success", 200, self.context)
        except OSError:
            # The other ranks are mid-generation; raising here would leave them waiting in a collective.
            logger.exception("could not send a stream chunk; the rest comes in the final reply")
            for idx in chunks:
                streams.pop(idx)
