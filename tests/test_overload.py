"""Overload: more requests than KV-cache slots wait in order, and past the bounded line get a 503.

A real TorchServe with 2 slots, a worker that holds 3 requests (batchSize) and a TorchServe queue
of 2 (job_queue_size): of 10 requests sent at once, the ones it holds are each answered with
their own text, the rest get TorchServe's 503 with a JSON body at once; none is lost or answered
twice. Then the server serves normally again. How many it holds depends on a race in TorchServe:
at least 3 (the first job the idle worker takes, then the queue's 2), up to 5 when the worker
polls more jobs before the queue fills.
"""

from __future__ import annotations

import json
import threading

import pytest


from tests.support.serving_util import TorchServe, without_cache


SLOTS, HELD, QUEUE, SENT = 2, 3, 2, 10


@pytest.fixture(scope="module")
def server(synthetic_checkpoint, serve):
    with serve(synthetic_checkpoint("llama3", mp=1), tp=1, max_batch_size=SLOTS, batchSize=HELD,
               max_new_tokens_limit=None, prefill_budget=None, maxBatchDelay=None, responseTimeout=None,
               torchrun={"OMP_NUMBER_THREADS": 1}, extra_config=[f"job_queue_size={QUEUE}"]) as ts:
        yield ts


def greedy(i: int) -> dict:
    return {"prompt": f"Request {i}: the lamp keeper wrote", "max_new_tokens": 60, "temperature": 0,
            "ignore_eos": True}


def test_requests_beyond_the_line_get_503_and_the_rest_their_own_text(server: TorchServe) -> None:
    alone = {i: server.predict(greedy(i)).json() for i in range(SENT)}
    replies: dict[int, object] = {}
    barrier = threading.Barrier(SENT)

    def send(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            replies[i] = server.predict(greedy(i), timeout=120)
        except Exception as exc:  # reported below
            replies[i] = exc

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(SENT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=150)
    assert len(replies) == SENT, "a request never came back"
    served = [i for i, r in replies.items() if getattr(r, "status", None) == 200]
    refused = [i for i, r in replies.items() if getattr(r, "status", None) == 503]
    assert sorted(served + refused) == list(range(SENT)), {i: r for i, r in replies.items() if i not in served + refused}
    assert len(served) >= 1 + QUEUE and refused, (served, refused)
    for i in served:
        assert without_cache(replies[i].json()) == without_cache(alone[i]), f"request {i} got another text"
    for i in refused:
        body = json.loads(replies[i].body)
        assert body["code"] == 503 and body["message"], body
    seen = len(server.finishes())
    assert without_cache(server.predict(greedy(0)).json()) == without_cache(alone[0])
    last = server.wait_for_finishes(seen + 1)[-1]
    assert (last["busy"], last["blocks"]) == (0, 0)
