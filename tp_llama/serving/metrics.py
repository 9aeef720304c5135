"""Serving metrics, sent through TorchServe's backend metrics to its Prometheus endpoint.

Rank 0 only. A metric update is one `[METRICS]...` line on the worker's stdout, which the
frontend parses into its Prometheus registry (config.properties: `metrics_mode=prometheus`,
and `model_metrics_auto_detect=true` so that metrics not declared in a metrics yaml are
registered on first sight; handler/server_config.py writes both). To keep that cheap:

- counters are summed over a call and sent once per call, only where they grew (the frontend
  parses and logs every line it gets);
- gauges are sent only when their value changed since the last call;
- histograms get one observation per request (time to first token when it comes, time per
  output token when the request ends); nothing is done per token.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from tp_llama.engine.scheduler import Sequence

logger = logging.getLogger(__name__)

PREFIX = "llama_"
TTFT = PREFIX + "time_to_first_token_seconds"
TPOT = PREFIX + "time_per_output_token_seconds"
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
GENERATED_TOKENS = PREFIX + "generation_tokens_total"
REQUESTS = PREFIX + "requests_total"
RUNNING = PREFIX + "running_sequences"
WAITING = PREFIX + "waiting_sequences"
KV_BLOCKS = PREFIX + "kv_cache_blocks_used"
KV_BLOCKS_TOTAL = PREFIX + "kv_cache_blocks_total"
PREFIX_QUERIES = PREFIX + "prefix_cache_queries_tokens_total"  # prompt tokens looked up in the prefix cache
PREFIX_HITS = PREFIX + "prefix_cache_hits_tokens_total"  # of those, found there (not prefilled)
PREEMPTIONS = PREFIX + "preemptions_total"  # sequences whose blocks were taken back, to be recomputed
# Speculative decoding, as vLLM reports it: rows that carried proposals (drafts), proposals made, accepted,
# and accepted at each position of a row's proposals (labelled as vLLM labels it: 0 = the first).
SPEC_DRAFTS = PREFIX + "spec_decode_num_drafts_total"
SPEC_PROPOSED = PREFIX + "spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = PREFIX + "spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_AT = PREFIX + "spec_decode_num_accepted_tokens_per_pos_total"
# LoRA: sequences ended on each adapter, and their prompt and generated tokens (the base's are the totals'
# rest).
LORA_SEQUENCES = PREFIX + "lora_sequences_total"
LORA_PROMPT_TOKENS = PREFIX + "lora_prompt_tokens_total"
LORA_GENERATED_TOKENS = PREFIX + "lora_generation_tokens_total"
# Llama 4: tokens routed to each expert of each MoE layer (prompt, generated and verified proposals).
EXPERT_TOKENS = PREFIX + "moe_expert_tokens_total"
OUTCOMES = ("ok", "4xx", "unavailable", "cancelled", "failed")

MODEL = "model_name"
OUTCOME = "outcome"
POSITION = "position"
ADAPTER = "adapter"
LAYER, EXPERT = "layer", "expert"


class ServingMetrics:
    """Collects a call's updates and emits them through TorchServe's metric cache (`context.metrics`).

    With `cache` None (unit tests, or a TorchServe without metrics) the numbers are still kept
    in `totals` and `gauges`, so they can be checked, but nothing is emitted.
    """

    def __init__(self, cache: Any, model_name: str, kv_blocks: int, speculative: bool = False) -> None:
        self.model = model_name
        self.metrics: dict[str, Any] = {}
        self.totals: Counter[tuple[str, str]] = Counter()  # (name, outcome, position or "") -> value, for tests
        self.observations: Counter[str] = Counter()  # histogram name -> observations, for tests
        self.gauges: dict[str, float] = {}
        self._counts: Counter[tuple[str, str | tuple[str, ...]]] = Counter()  # labels: one, or (layer, expert)
        if cache is not None:
            try:
                self._declare(cache)
            except Exception:  # metrics must never stop the model from serving
                logger.exception("could not set up the serving metrics; serving without them")
                self.metrics = {}
        # Series that exist from the start, so that rate() sees the first increment.
        for outcome in OUTCOMES:
            self._emit(REQUESTS, 0, outcome)
        speculation = (SPEC_DRAFTS, SPEC_PROPOSED, SPEC_ACCEPTED) if speculative else ()
        for name in (PROMPT_TOKENS, GENERATED_TOKENS, PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS, *speculation):
            self._emit(name, 0)
        self._scheduler_totals = (0, 0, 0)
        self._speculated: tuple[int, int, int, list[int]] = (0, 0, 0, [])
        self._routed: dict[tuple[int, int], int] = {}
        self._set(KV_BLOCKS_TOTAL, kv_blocks)
        self.update_gauges(0, 0, 0)

    def _declare(self, cache: Any) -> None:
        from ts.metrics.metric_type_enum import MetricTypes

        for name, unit, kind, dims in (
            (TTFT, "s", MetricTypes.HISTOGRAM, [MODEL]),
            (TPOT, "s", MetricTypes.HISTOGRAM, [MODEL]),
            (PROMPT_TOKENS, "tokens", MetricTypes.COUNTER, [MODEL]),
            (GENERATED_TOKENS, "tokens", MetricTypes.COUNTER, [MODEL]),
            (REQUESTS, "requests", MetricTypes.COUNTER, [MODEL, OUTCOME]),
            (RUNNING, "sequences", MetricTypes.GAUGE, [MODEL]),
            (WAITING, "sequences", MetricTypes.GAUGE, [MODEL]),
            (KV_BLOCKS, "blocks", MetricTypes.GAUGE, [MODEL]),
            (KV_BLOCKS_TOTAL, "blocks", MetricTypes.GAUGE, [MODEL]),
            (PREFIX_QUERIES, "tokens", MetricTypes.COUNTER, [MODEL]),
            (PREFIX_HITS, "tokens", MetricTypes.COUNTER, [MODEL]),
            (PREEMPTIONS, "sequences", MetricTypes.COUNTER, [MODEL]),
            (SPEC_DRAFTS, "drafts", MetricTypes.COUNTER, [MODEL]),
            (SPEC_PROPOSED, "tokens", MetricTypes.COUNTER, [MODEL]),
            (SPEC_ACCEPTED, "tokens", MetricTypes.COUNTER, [MODEL]),
            (SPEC_ACCEPTED_AT, "tokens", MetricTypes.COUNTER, [MODEL, POSITION]),
            (LORA_SEQUENCES, "sequences", MetricTypes.COUNTER, [MODEL, ADAPTER]),
            (LORA_PROMPT_TOKENS, "tokens", MetricTypes.COUNTER, [MODEL, ADAPTER]),
            (LORA_GENERATED_TOKENS, "tokens", MetricTypes.COUNTER, [MODEL, ADAPTER]),
            (EXPERT_TOKENS, "tokens", MetricTypes.COUNTER, [MODEL, LAYER, EXPERT]),
        ):
            self.metrics[name] = cache.add_metric_to_cache(name, unit, dims, kind)

    def _emit(self, name: str, value: float, *labels: str) -> None:
        metric = self.metrics.get(name)
        if metric is not None:
            metric.add_or_update(value, [self.model, *labels])

    def request(self, outcome: str) -> None:
        """A request answered: ok, 4xx, cancelled or failed."""
        self._counts[(REQUESTS, outcome)] += 1

    def first_token(self, seq: Sequence) -> None:
        """Seconds from admission (the handler's first sight of the request) to its first token."""
        self.observations[TTFT] += 1
        self._emit(TTFT, round(seq.first_token_at - seq.arrived, 6))

    def ended(self, seq: Sequence, prompt: bool = True) -> None:
        """Token counts of a sequence that ended (whatever the outcome), and its time per output token. prompt:
        False for the later sequences of a group (n > 1), whose prompt is prefilled, and counted in usage, once."""
        prompt_tokens = len(seq.prompt_ids) if prompt else 0
        self._counts[(PROMPT_TOKENS, "")] += prompt_tokens
        self._counts[(GENERATED_TOKENS, "")] += len(seq.output)
        if seq.adapter is not None:
            self._counts[(LORA_SEQUENCES, seq.adapter)] += 1
            self._counts[(LORA_PROMPT_TOKENS, seq.adapter)] += prompt_tokens
            self._counts[(LORA_GENERATED_TOKENS, seq.adapter)] += len(seq.output)
        done = seq.finished_at
        if done is not None and seq.first_token_at is not None and len(seq.output) >= 2:
            self.observations[TPOT] += 1
            self._emit(TPOT, round((done - seq.first_token_at) / (len(seq.output) - 1), 6))

    def update_gauges(self, running: int, waiting: int, kv_blocks_used: int) -> None:
        self._set(RUNNING, running)
        self._set(WAITING, waiting)
        self._set(KV_BLOCKS, kv_blocks_used)

    def cache_counts(self, queries: int, hits: int, preemptions: int) -> None:
        """The scheduler's running totals; what grew since the last call is counted."""
        for name, now, before in zip((PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS), (queries, hits, preemptions),
                                     self._scheduler_totals):
            self._counts[(name, "")] += now - before
        self._scheduler_totals = (queries, hits, preemptions)

    def speculation(self, drafts: int, proposed: int, accepted: int, accepted_at: list[int]) -> None:
        """The speculator's running totals (engine/speculate.py); what grew since the last call is counted."""
        before_drafts, before_proposed, before_accepted, before_at = self._speculated
        self._counts[(SPEC_DRAFTS, "")] += drafts - before_drafts
        self._counts[(SPEC_PROPOSED, "")] += proposed - before_proposed
        self._counts[(SPEC_ACCEPTED, "")] += accepted - before_accepted
        for i, now in enumerate(accepted_at):
            self._counts[(SPEC_ACCEPTED_AT, str(i))] += now - (before_at[i] if i < len(before_at) else 0)
        self._speculated = (drafts, proposed, accepted, list(accepted_at))

    def experts(self, routed: dict[tuple[int, int], int]) -> None:
        """The engine's running totals of tokens per (layer, expert) (Engine.expert_tokens); what grew is
        counted, labelled (layer, expert)."""
        for (layer, expert), now in routed.items():
            self._counts[(EXPERT_TOKENS, (str(layer), str(expert)))] += now - self._routed.get((layer, expert), 0)
        self._routed = dict(routed)

    def _set(self, name: str, value: float) -> None:
        if self.gauges.get(name) != value:
            self.gauges[name] = value
            self._emit(name, value)

    def flush(self) -> None:
        """Send the call's counter increments, one line per series that grew."""
        for (name, label), value in self._counts.items():
            if value:
                self.totals[(name, label)] += value
                self._emit(name, value, *(label if isinstance(label, tuple) else [label] if label else []))
        self._counts.clear()
