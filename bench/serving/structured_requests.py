"""bench/serving/structured.py's requests: one streamed /v1/completions request (its text and finish
reason kept, to validate), the constrained and unconstrained bodies, and a level of clients sending them.

Both servers get the same requests: request k of a run is seeded k + 1 and, constrained, asks for schema
k mod 8 of the tests' corpus (tests/support/schemas.py).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import jsonschema

from bench.serving.clients import Send, run_level, sse_chunks
from tests.support.schemas import NAMES, SCHEMAS

MODES = ("constrained", "unconstrained")


@dataclass
class Target:
    """A server up and warmed: where its completions go, its process tree, what the JSON keeps of it."""

    port: int
    path: str
    headers: dict[str, str]
    fields: dict
    process: subprocess.Popen | None
    info: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- one request

def completion(target: Target, body: dict, timeout: float) -> dict:
    """One streaming /v1/completions request; times in seconds from sending, the reply's text and
    finish_reason, usage's token counts."""
    conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=timeout)
    body = {**body, **target.fields, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    try:
        conn.request("POST", target.path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **target.headers})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        first, usage, text, finish = None, None, [], None
        for chunk in sse_chunks(response):
            for choice in chunk.get("choices") or []:
                first = first if first is not None else time.perf_counter() - started
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
        latency = time.perf_counter() - started
        if usage is None:
            raise RuntimeError("no usage in the stream")
        return {"ttft_s": first, "latency_s": latency, "tokens": usage["completion_tokens"],
                "prompt_tokens": usage["prompt_tokens"], "text": "".join(text), "finish_reason": finish}
    finally:
        conn.close()


def sampling(a: argparse.Namespace, k: int) -> dict:
    if a.sampling == "greedy":
        return {"temperature": 0.0, "top_p": 1.0}
    return {"temperature": 1.0, "top_p": 1.0, "seed": k + 1}


def constrained_body(schema: int, max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "response_format": {"type": "json_schema", "json_schema": {
        "name": f"corpus_{schema}", "schema": SCHEMAS[schema]}}}


def invalid(text: str, schema: int) -> str | None:
    """Why a reply does not validate against its schema (None: it does)."""
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[schema], format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"{NAMES[schema]}: {text[:100]!r}: {str(exc).splitlines()[0][:100]}"
    return None


def sender(target: Target, mode: str, a: argparse.Namespace, outcomes: list[dict]) -> Send:
    """Request k of a run: its seed k + 1 and, constrained, schema k mod 8; each reply's outcome kept."""
    counter, lock = itertools.count(), threading.Lock()

    def send(prompt: list[int], new_tokens: int) -> dict:
        k = next(counter)
        schema = k % len(SCHEMAS)
        body = {"prompt": prompt, **sampling(a, k)}
        if mode == "constrained":
            body.update(constrained_body(schema, a.max_tokens))
        else:
            body.update(max_tokens=new_tokens, ignore_eos=True)
        reply = completion(target, body, a.timeout)
        outcome = {"schema": schema, "tokens": reply["tokens"], "finish_reason": reply["finish_reason"]}
        if mode == "constrained":
            outcome["invalid"] = invalid(reply["text"], schema)
        with lock:
            outcomes.append(outcome)
        return reply

    return send


def run_mode(target: Target, mode: str, clients: int, ids: list[int], a: argparse.Namespace) -> dict:
    """One level of one kind of request: run_level's timings with the replies' outcomes."""
    outcomes: list[dict] = []
    level = run_level(sender(target, mode, a, outcomes), ids, clients, a.requests, a.new_tokens)
    level.pop("short_replies", None)
    level["finish_reasons"] = dict(Counter(o["finish_reason"] for o in outcomes))
    level["tokens_mean"] = statistics.mean(o["tokens"] for o in outcomes) if outcomes else None
    if mode == "constrained":
        bad = [o["invalid"] for o in outcomes if o["invalid"]]
        level["invalid"], level["invalid_samples"] = len(bad), bad[:3]
    return level

