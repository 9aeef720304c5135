"""End to end: a synthetic checkpoint served by a real TorchServe with a 2-rank torchrun worker.

Per tokenizer family, the module builds an archive, starts TorchServe on free loopback ports
and checks REST against the offline CLI, streaming, concurrency, bad input and shutdown.
Every wait has a fixed timeout and the server fixture stops every process it started.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest


from deploy.make_archive import build_archive
from tests.support.serving_util import VENV_BIN, TorchServe, free_ports, port_is_open, without_cache
from tp_llama.testing.synthetic import write_checkpoint

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Grüße aus Köln: the quick brown fox"
MAX_NEW = 24
MAX_SEQ_LEN = 256
NEW_TOKENS_LIMIT = 200
MAX_BODY = 4096
STARTUP_TIMEOUT = 240
CLI_TIMEOUT = 300
# Exact comparisons (REST = CLI, together = alone) need float32: bfloat16 rounding depends on the
# batch a row runs in (tests/test_bf16.py checks bfloat16 against float32 within its rounding).
DTYPE = "float32"


def _run(command: list[str], timeout: float, cwd: Path = REPO) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module", params=[("llama2", "tp"), ("llama3", "fsdp")], ids=["llama2-tp", "llama3-fsdp"])
def setup(request: pytest.FixtureRequest) -> tuple[str, str]:
    """Tokenizer family and loading mode: each family once, each mode once."""
    return request.param


@pytest.fixture(scope="module")
def checkpoint(setup: tuple[str, str], synthetic_checkpoint) -> Path:
    return synthetic_checkpoint(setup[0])


@pytest.fixture(scope="module")
def cli_reference(checkpoint: Path, setup: tuple[str, str]) -> dict:
    """The offline CLI's greedy output, torchrun with 2 ranks like the server."""
    stdout = _run(
        [
            str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "tp_llama.generate",
            "--ckpt-dir", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW),
            "--temperature", "0", "--max-seq-len", str(MAX_SEQ_LEN), "--mode", setup[1], "--dtype", DTYPE,
        ],
        CLI_TIMEOUT,
    )
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def server(checkpoint: Path, setup: tuple[str, str], serve):
    # tp mode serves with speculative decoding, the checkpoint drafting for itself as a second checkpoint
    # would (a draft model at TP 2, its plans broadcast beside the served model's, its own KV cache fed
    # by catching up; the int4 self-draft needs groups of 32 that this shape's TP 2 slices split): its
    # replies must still be the offline CLI's, which runs without it.
    speculation = {"speculative": "draft", "draft_ckpt_dir": str(checkpoint)} if setup[1] == "tp" else {}
    with serve(checkpoint, max_seq_len=MAX_SEQ_LEN, max_new_tokens_limit=NEW_TOKENS_LIMIT,
               default_max_new_tokens=MAX_NEW, max_request_bytes=MAX_BODY, mode=setup[1], dtype=DTYPE,
               batchSize=6, **speculation) as ts:
        yield ts


def greedy(prompt: str = PROMPT, **extra) -> dict:
    return {"prompt": prompt, "max_new_tokens": MAX_NEW, "temperature": 0, **extra}


def test_greedy_rest_matches_offline_cli(server: TorchServe, cli_reference: dict) -> None:
    started = time.monotonic()
    reply = server.predict(greedy())
    latency = time.monotonic() - started
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"].startswith("application/json")
    body = reply.json()
    assert set(body) == {"text", "token_ids", "finish_reason", "usage"}
    for key in ("token_ids", "text", "finish_reason", "usage"):
        assert without_cache(body)[key] == without_cache(cli_reference)[key], key
    print(f"startup {server.startup_s:.1f} s, greedy {MAX_NEW}-token request {latency:.2f} s")


def test_speculation_proposed_where_it_is_on(server: TorchServe, setup: tuple[str, str]) -> None:
    """The greedy replies above equal the CLI's with speculative decoding on (tp) and off (fsdp); its
    proposals counter on /metrics shows it ran."""
    for prompt in (PROMPT, "a b c a b c a b c", "one two three four one two three four"):
        assert server.predict(greedy(prompt)).status == 200
    metrics = server.request("GET", "/metrics", port=server.metrics_port, key=None, timeout=30).body.decode()
    found = re.search(r"^llama_spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)$", metrics, re.M)
    proposed = float(found[1]) if found else 0.0
    assert (proposed > 0) == (setup[1] == "tp"), metrics[-2000:]


def test_stream_chunks_add_up_to_the_full_reply(server: TorchServe) -> None:
    full = server.predict(greedy()).json()
    status, chunks = server.predict_stream(greedy(stream=True))
    assert status == 200
    assert len(chunks) >= 2
    assert all(set(c) == {"text", "token_ids"} for c in chunks[:-1])
    assert chunks[-1]["finish_reason"] == full["finish_reason"]
    assert without_cache(chunks[-1])["usage"] == without_cache(full)["usage"]
    assert chunks[-1]["usage"]["cached_prompt_tokens"] >= full["usage"]["cached_prompt_tokens"]  # the same prompt again
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["token_ids"]] == full["token_ids"]


def test_chat_request_uses_the_family_template(server: TorchServe, tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there ✓"}]
    reply = server.predict({"messages": messages, "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert reply.status == 200, reply.body
    body = reply.json()
    assert without_cache(body)["usage"] == {"prompt_tokens": len(tokenizer.encode_chat(messages)), "completion_tokens": 8}
    assert body["finish_reason"] == "length"
    assert body["text"] == tokenizer.decode(body["token_ids"])


def _concurrently(calls: list) -> list:
    """Run the calls at the same moment (so TorchServe batches them); each gets a fixed timeout."""
    results: list = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def worker(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            results[i] = calls[i]()
        except Exception as exc:  # reported by the assertions below
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    return results


def test_concurrent_requests_each_get_their_own_result(server: TorchServe) -> None:
    # Long enough that requests sent together overlap: stepping between TorchServe's calls, a reply of a
    # few tokens could end before the next request came in.
    payloads = [
        greedy(f"Request number {i}: tell me about {word}", max_new_tokens=24 + i, ignore_eos=True)
        for i, word in enumerate(["cats", "Zürich", "rivers", "日本", "tea", "stars"])
    ]
    before = len(server.finishes())
    alone = [server.predict(p).json() for p in payloads]
    seen = len(server.wait_for_finishes(before + len(payloads)))  # the last one's line may trail its reply
    calls = [
        (lambda p=p: server.predict_stream({**p, "stream": True})) if i % 2 else (lambda p=p: server.predict(p))
        for i, p in enumerate(payloads)
    ]
    together = _concurrently(calls)
    for i, (expected, got) in enumerate(zip(alone, together)):
        assert not isinstance(got, Exception), got
        if i % 2:
            status, chunks = got
            assert status == 200
            got_ids = [t for c in chunks for t in c["token_ids"]]
            got_text = "".join(c["text"] for c in chunks)
            assert without_cache(chunks[-1])["usage"] == without_cache(expected)["usage"]
        else:
            assert got.status == 200, got.body
            got_ids, got_text = got.json()["token_ids"], got.json()["text"]
        assert got_ids == expected["token_ids"], i
        assert got_text == expected["text"], i
        assert expected["usage"]["completion_tokens"] == payloads[i]["max_new_tokens"]
    ended = server.wait_for_finishes(seen + len(payloads))[seen:]
    assert len(ended) == len(payloads) and all(e["how"] == "length" for e in ended), ended
    assert max(e["busy"] for e in ended) >= 1, "every request ran alone: none shared a step with another"


BAD_REQUESTS = [
    (b'{"prompt": "hi"', "not valid JSON"),
    (b'\xff\xfe{"prompt": "hi"}', "not valid UTF-8"),
    (b'["prompt"]', "must be a JSON object"),
    (b'{"prompt": "hi", "colour": "red"}', "unknown field"),
    (b'{"prompt": "hi", "max_new_tokens": "5"}', "max_new_tokens must be an integer"),
    (b'{"prompt": "hi", "max_new_tokens": true}', "max_new_tokens must be an integer"),
    (b'{"prompt": "hi", "max_new_tokens": 2.5}', "max_new_tokens must be an integer"),
    (b'{"prompt": "hi", "max_new_tokens": 0}', "max_new_tokens must be >= 1"),
    (b'{"prompt": "hi", "max_new_tokens": 201}', "exceeds the limit"),
    (b'{"prompt": "hi", "temperature": -0.5}', "temperature must be >= 0"),
    (b'{"prompt": "hi", "temperature": NaN}', "not valid JSON"),
    (b'{"prompt": "hi", "top_p": 0}', "top_p must be in (0, 1]"),
    (b'{"prompt": "hi", "top_p": 1.5}', "top_p must be in (0, 1]"),
    (b'{"prompt": "hi", "seed": -1}', "seed must be in"),
    (b'{"prompt": "hi", "stream": "yes"}', "stream must be true or false"),
    (b'{"prompt": "hi", "ignore_eos": 1}', "ignore_eos must be true or false"),
    (b'{"prompt": ""}', "prompt must not be empty"),
    (b'{"prompt": 42}', "prompt must be a string"),
    (b'{"max_new_tokens": 4}', "exactly one of"),
    (b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}', "exactly one of"),
    (b'{"messages": []}', "non-empty array"),
    (b'{"messages": [{"role": "robot", "content": "hi"}]}', "role must be one of"),
    (b'{"messages": [{"role": "user", "content": 7}]}', "content must be a str"),
    (b'{"messages": [{"role": "user", "content": "hi", "name": "x"}]}', "unknown field"),
    (json.dumps({"prompt": "word " * 40, "max_new_tokens": 200}).encode(), "exceeds max_seq_len"),
    (json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode(), "the limit is"),
    (b'{"prompt": "\\ud83d"}', "unpaired UTF-16 surrogate"),
]


def test_each_bad_request_gets_400_and_the_server_keeps_serving(server: TorchServe) -> None:
    for body, expected in BAD_REQUESTS:
        reply = server.predict(body)
        assert reply.status == 400, (body[:80], reply.status, reply.body)
        error = reply.json()["error"]
        assert expected in error, (body[:80], error)
    form = server.predict(b"prompt=hi", content_type="application/x-www-form-urlencoded")
    assert form.status == 400 and "application/json" in form.json()["error"]
    reply = server.predict(greedy())
    assert reply.status == 200, reply.body


def test_bad_and_good_requests_sent_together(server: TorchServe) -> None:
    """A bad request arriving beside good ones is answered at once and never disturbs them."""
    expected = server.predict(greedy()).json()
    for _ in range(3):
        bad, good, also_good = _concurrently([lambda: server.predict(b'{"prompt": 1}'),
                                              lambda: server.predict(greedy()), lambda: server.predict(greedy())])
        assert bad.status == 400 and "prompt must be a string" in bad.json()["error"]
        assert good.status == 200 and without_cache(good.json()) == without_cache(expected)
        assert also_good.status == 200 and without_cache(also_good.json()) == without_cache(expected)


def test_a_short_request_joins_a_running_long_one(server: TorchServe) -> None:
    """Continuous batching: the short request answers while the long one is still generating."""
    long = greedy(max_new_tokens=NEW_TOKENS_LIMIT, ignore_eos=True)
    short = greedy("Hello", max_new_tokens=4, ignore_eos=True)
    alone = server.predict(short).json()
    finished: dict[str, float] = {}

    def timed(name: str, payload: dict):
        def call():
            reply = server.predict(payload)
            finished[name] = time.monotonic()
            return reply
        return call

    def short_later():
        time.sleep(0.3)
        return timed("short", short)()

    long_reply, short_reply = _concurrently([timed("long", long), short_later])
    assert long_reply.status == 200 and short_reply.status == 200
    assert without_cache(short_reply.json()) == without_cache(alone)
    assert finished["short"] < finished["long"], "the short request waited for the long one"


def test_a_disconnected_client_frees_its_slot(server: TorchServe) -> None:
    seen = len(server.finishes())
    conn = http.client.HTTPConnection("127.0.0.1", server.inference_port, timeout=60)
    conn.request("POST", f"/predictions/{server.name}",
                 body=json.dumps(greedy(max_new_tokens=NEW_TOKENS_LIMIT, ignore_eos=True, stream=True)).encode(),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {server.keys()['inference']}"})
    response = conn.getresponse()
    assert response.status == 200
    response.readline()  # the first chunk: the request is running
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        reply = server.predict(greedy(max_new_tokens=2))  # TorchServe tells the handler on its next call
        assert reply.status == 200
        ended = server.finishes()[seen:]
        cancelled = [e for e in ended if "disconnected" in e["how"]]
        if cancelled:
            assert cancelled[0]["tokens"] < NEW_TOKENS_LIMIT
            assert (ended[-1]["busy"], ended[-1]["blocks"]) == (0, 0), ended
            return
        time.sleep(0.2)
    pytest.fail(f"the disconnected request was never cancelled: {server.finishes()[seen:]}")


def test_secure_defaults_no_token_no_tcp_management(server: TorchServe) -> None:
    """Loopback only, token authorization on, management on the unix socket, bodies capped."""
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        status = _post_with(server, headers)
        assert 400 <= status < 500, (headers, status)
    assert server.management_port is None and server.management_socket.is_socket()
    assert server.management("GET", "/models", key=None).status in (400, 401, 403)
    assert server.management("GET", "/models").status == 200
    assert "Management API bind to: unix:" in server.log_path.read_text(errors="replace")
    frontend = [p for p in server.tree.values() if p.is_running() and p.name() == "java"]
    assert len(frontend) == 1
    listening = [c.laddr for c in frontend[0].net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert {a.ip for a in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
    assert {a.port for a in listening} == {server.inference_port, server.metrics_port,
                                           server.grpc_inference_port, server.grpc_management_port}
    assert server.predict(b'{"prompt": "' + b"x" * (2 * 1024 * 1024) + b'"}').status == 413


def _post_with(server: TorchServe, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.inference_port, timeout=60)
    try:
        conn.request("POST", f"/predictions/{server.name}", body=json.dumps(greedy()).encode(),
                     headers={"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_server_stops_cleanly(server: TorchServe) -> None:
    port = server.inference_port
    outcome = server.stop()
    assert outcome["returncode"] == 0, server.log_tail()
    assert outcome["leftover"] == [], f"processes still alive after stop: {outcome['leftover']}"
    assert not port_is_open(port)


def _tokenizer_past_the_embedding(ckpt: Path) -> str:
    """SmolLM2 converted: a row per BPE rank, none for the special ids Llama 3's layout appends."""
    write_checkpoint(ckpt, family="llama3", vocab_size=512, model_vocab=256)
    return "the tokenizer makes 512 ids (llama3 format) but"


def test_a_bad_checkpoint_fails_fast_with_a_clear_message(tmp_path: Path) -> None:
    """The load fails with the cause in the log, and so does every start TorchServe retries (it retries
    any failed worker, with a growing back-off): no worker ever serves the broken checkpoint. A shard that
    cannot be read, through TorchServe: test_reliability.py's load faults; a missing one: test_bad_checkpoints.py."""
    ckpt = tmp_path / "ckpt"
    cause = _tokenizer_past_the_embedding(ckpt)
    (rdzv_port,) = free_ports(1)
    build_archive(ckpt, tmp_path / "model_store", overrides=[f"torchrun.rdzv-endpoint=127.0.0.1:{rdzv_port}"])
    with TorchServe(tmp_path, tmp_path / "model_store", "llama") as ts:
        ts.start()
        with pytest.raises(RuntimeError, match="failed to load"):
            ts.wait_ready(STARTUP_TIMEOUT)
        log = ts.model_log()
        outcome = ts.stop()
    attempts = log.count("rank 0] loading ")
    assert attempts >= 1 and log.count(cause) >= attempts, f"a load got past the cause:\n{log[-4000:]}"
    assert "rank 0] loaded in" not in log
    assert outcome["leftover"] == []
