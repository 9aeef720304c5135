"""The handler served on a GPU, in one command: `python -m checks.gpu_serve` from the repository root,
with the folder checks/gpu_bundle.py writes first on PYTHONPATH where TorchServe is not installed.

1. Writes a Llama 3 8B-shaped checkpoint of random weights (made on the device, as checks/gpu_check.py
   makes them) in Meta's layout, with Meta's Llama 3 tokenizer, and builds its model folder with
   deploy/make_archive.py: `deviceType: "gpu"`, TP 1, bfloat16, every other key the yaml's default
   (the KV pool sized from free GPU memory, decode steps compiled and captured in CUDA graphs).
2. Starts the handler the way TorchServe does: TorchServe's own Python worker under torchrun, driven
   by checks/ts_frontend.py, the stand-in for its Java frontend (which does not fit the GPU machine).
3. Checks the native API and the OpenAI API through it: completions and chat, plain and streamed, a
   JSON schema, `n` = 2, and a bad request's 4xx with the server serving on.
4. Served output tokens/s, TTFT and TPOT at each client count (each request a prompt of its own, --prompt
   tokens, --new tokens, greedy, end of sequence ignored), then the engine's offline rate on the same
   checkpoint and settings in this process, the same sequences all at once: the serving overhead as a ratio.

Prints one table and exits 1 if a check failed; stops everything it started. `--device cpu --small`
runs the same path on CPU with a small checkpoint (tests/test_gpu_serve.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.serving.clients import openai_stream, run_level, sse_chunks
from checks.gpu_bundle import llama3_tokenizer
from checks.gpu_check import random_state
from checks.ts_frontend import Frontend, WorkerGroup
from deploy.make_archive import build_archive
from tp_llama.checkpoint.params import parse_params
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.serving.settings import check_model_config
from tp_llama.testing.synthetic import params_json

SHAPES = {  # (dim, layers, heads, KV heads, multiple_of, ffn_dim_multiplier)
    "8b": (4096, 32, 32, 8, 1024, 1.3),
    "small": (128, 2, 4, 2, 32, None),
}
VOCAB = 128256  # Meta's Llama 3 tokenizer: 128,000 BPE ids and 256 special ones
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
ROWS: list[tuple[str, str, bool]] = []  # (check, result, ok)


def tokenizer_path() -> Path:
    """Meta's Llama 3 tokenizer: the bundle's copy beside `ts` on the GPU machine, else llama-models'."""
    try:
        import ts

        bundled = Path(ts.__file__).parent.parent / "tokenizer.model"
        if bundled.is_file():
            return bundled
    except ImportError:
        pass
    return llama3_tokenizer()


def write_checkpoint(folder: Path, shape: str, device: str) -> Path:
    """params.json, tokenizer.model and consolidated.00.pth (bfloat16 weights made on `device`)."""
    folder.mkdir(parents=True, exist_ok=True)
    dim, layers, heads, kv_heads, multiple_of, multiplier = SHAPES[shape]
    params = params_json("llama3", dim, layers, heads, kv_heads, VOCAB, multiple_of, multiplier)
    (folder / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    shutil.copyfile(tokenizer_path(), folder / "tokenizer.model")
    args = parse_params(params, folder / "params.json", VOCAB)
    state = random_state(args, seed=0, device=device, dtype=torch.bfloat16)
    torch.save({key: tensor.cpu() for key, tensor in state.items()}, folder / "consolidated.00.pth")
    del state
    if device == "cuda":
        torch.cuda.empty_cache()  # the worker sizes its KV pool from the memory left free
    return folder


def record(check: str, result: str, ok: bool) -> bool:
    ROWS.append((check, result, ok))
    print(f"{'ok ' if ok else 'FAIL'} {check}: {result}", file=sys.stderr, flush=True)
    return ok


def post(port: int, path: str, body: dict | bytes, timeout: float = 120) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def stream(port: int, path: str, body: dict, timeout: float = 120) -> tuple[int, list[dict]]:
    """A streamed reply's payloads: SSE `data:` chunks (OpenAI) or JSON lines (native)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if "/v1/" in path:
            return response.status, list(sse_chunks(response))
        return response.status, [json.loads(line) for line in response if line.strip()]
    finally:
        conn.close()


def api_checks(port: int, name: str) -> None:
    """Each front door once through the stand-in frontend and TorchServe's worker."""
    native, v1 = f"/predictions/{name}", f"/predictions/{name}/1.0/v1"
    greedy = {"temperature": 0, "ignore_eos": True}
    status, raw = post(port, native, {"prompt": "The capital of France is", "max_new_tokens": 8, **greedy})
    reply = json.loads(raw) if status == 200 else {}
    record("native", f"HTTP {status}, {reply.get('usage', {}).get('completion_tokens')} tokens",
           status == 200 and len(reply.get("token_ids", [])) == 8)
    status, lines = stream(port, native, {"prompt": "Once upon a time", "max_new_tokens": 8, "stream": True, **greedy})
    got = sum(len(line.get("token_ids", [])) for line in lines)
    record("native, streamed", f"HTTP {status}, {len(lines)} lines, {got} tokens", status == 200 and got == 8)
    status, raw = post(port, f"{v1}/completions", {"model": name, "prompt": "Hello", "max_tokens": 8, **greedy})
    reply = json.loads(raw) if status == 200 else {}
    record("completions", f"HTTP {status}, usage {reply.get('usage')}",
           status == 200 and reply["usage"]["completion_tokens"] == 8 and isinstance(reply["choices"][0]["text"], str))
    status, chunks = stream(port, f"{v1}/completions", {"model": name, "prompt": "Hello", "max_tokens": 8,
                                                        "stream": True, "stream_options": {"include_usage": True},
                                                        **greedy})
    usage = next((c["usage"] for c in chunks if c.get("usage")), {})
    record("completions, streamed", f"HTTP {status}, {len(chunks)} chunks, usage {usage}",
           status == 200 and usage.get("completion_tokens") == 8)
    chat = {"model": name, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, **greedy}
    status, raw = post(port, f"{v1}/chat/completions", chat)
    reply = json.loads(raw) if status == 200 else {}
    record("chat", f"HTTP {status}, finish {reply.get('choices', [{}])[0].get('finish_reason')}",
           status == 200 and reply["choices"][0]["message"]["role"] == "assistant")
    status, chunks = stream(port, f"{v1}/chat/completions", {**chat, "stream": True})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    record("chat, streamed", f"HTTP {status}, {len(chunks)} chunks, {len(text)} characters",
           status == 200 and len(chunks) >= 2)
    schema = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    status, raw = post(port, f"{v1}/chat/completions", {"model": name, "messages": [{"role": "user", "content": "Yes?"}],
                                                        "max_tokens": 64, "temperature": 0, "response_format": schema})
    content = json.loads(raw)["choices"][0]["message"]["content"] if status == 200 else ""
    try:
        value = json.loads(content)
        valid = (set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no")
                 and isinstance(value["sure"], bool))
    except (ValueError, TypeError):
        valid = False
    record("JSON schema (chat)", f"HTTP {status}, {content[:60]!r}", status == 200 and valid)
    status, raw = post(port, f"{v1}/completions", {"model": name, "prompt": "Hello", "max_tokens": 6, "n": 2,
                                                   "temperature": 0.8, "seed": 3, "ignore_eos": True})
    choices = json.loads(raw).get("choices", []) if status == 200 else []
    record("n = 2", f"HTTP {status}, {len(choices)} choices",
           status == 200 and sorted(c["index"] for c in choices) == [0, 1])
    status, raw = post(port, f"{v1}/completions", {"model": name, "prompt": "Hello", "max_tokens": -1})
    message = json.loads(raw).get("error", {}).get("message", "") if raw.startswith(b"{") else raw[:80]
    record("bad request", f"HTTP {status}: {message!r}", 400 <= status < 500 and bool(message))
    status, _ = post(port, f"{v1}/completions", {"model": name, "prompt": "Hello", "max_tokens": 2, **greedy})
    record("serving after the 4xx", f"HTTP {status}", status == 200)


def prompt_source(seed: int, length: int) -> Any:
    """Each call: a prompt of its own (so the prefix cache shares nothing between requests)."""
    rng = random.Random(seed)
    return lambda: [128000] + [rng.randrange(200, 100000) for _ in range(length - 1)]


def served_levels(port: int, name: str, clients: list[int], per_client: int, prompt: int, new: int) -> list[dict]:
    path = f"/predictions/{name}/1.0/v1/completions"
    levels = []
    for count in clients:
        fresh = prompt_source(count, prompt)
        send = lambda _p, n: openai_stream(port, path, fresh(), n, {}, {})  # noqa: E731
        run_level(send, None, count, 1, new)  # untimed: a new prompt shape's first kernels
        level = run_level(send, None, count, per_client, new)
        record(f"served, {count} clients", f"{level['tokens_per_s']:.0f} tokens/s, {level['errors']} errors",
               level["errors"] == 0 and level.get("short_replies") == 0)
        levels.append(level)
    return levels


def offline_engine(model_dir: Path) -> Engine:
    """The engine alone, in this process, on the model folder's settings."""
    config = yaml.safe_load((model_dir / "model-config.yaml").read_text())
    settings = check_model_config(config)
    return Engine.load(replace(settings.engine, device="cuda" if config.get("deviceType") == "gpu" else "cpu"))


def offline_rates(engine: Engine, clients: list[int], prompt: int, new: int) -> dict[int, float]:
    """Output tokens/s of each level's sequences all at once, each level run once untimed first (a new
    prompt shape's first kernels)."""
    rates = {}
    for count in clients:
        fresh = prompt_source(1000 + count, prompt)
        for _ in range(2):
            seqs = [Sequence(f"o{count}-{i}", fresh(), SamplingParams(new, ignore_eos=True)) for i in range(count)]
            started = time.perf_counter()
            engine.generate(seqs)
            rates[count] = sum(len(s.output) for s in seqs) / (time.perf_counter() - started)
    return rates


def table(levels: list[dict], offline: dict[int, float]) -> str:
    lines = ["| check | result | |", "|---|---|---|"]
    lines += [f"| {check} | {result} | {'ok' if ok else 'FAIL'} |" for check, result, ok in ROWS]
    lines += ["", "| clients | served tokens/s | TTFT p50 ms | TPOT p50 ms | offline tokens/s | served / offline |",
              "|---|---|---|---|---|---|"]
    for level in levels:
        rate = offline.get(level["clients"])
        ratio = f"{level['tokens_per_s'] / rate:.2f}" if rate else "-"
        ttft, tpot = level.get("ttft_p50_s") or 0, level.get("tpot_p50_s") or 0
        lines.append(f"| {level['clients']} | {level['tokens_per_s']:.0f} | {1000 * ttft:.1f} | {1000 * tpot:.2f} | "
                     f"{rate or 0:.0f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="a small model, not the 8B shape")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--per-client", type=int, default=4, help="requests each client sends, back to back")
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens of each request")
    parser.add_argument("--new", type=int, default=64, help="new tokens of each request")
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoint, the model folder and the "
                        "worker's log and sockets go (a short path; default: a temporary folder, removed at the end)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="another model-config.yaml key for the model folder")
    a = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: stop the worker on the way out
    work = a.work or Path(tempfile.mkdtemp(prefix="tpls-gs-", dir="/tmp"))
    started = time.perf_counter()
    levels: list[dict] = []
    offline: dict[int, float] = {}
    try:
        ckpt = write_checkpoint(work / "ckpt", "small" if a.small else "8b", a.device)
        record("checkpoint written", f"{time.perf_counter() - started:.0f} s", True)
        max_rows = max(a.clients)
        model_dir = build_archive(ckpt, work / "store", "llama", tp=1, overrides=[
            f"deviceType={'gpu' if a.device == 'cuda' else 'cpu'}", "handler.dtype=bfloat16",
            f"handler.max_batch_size={max_rows}", f"batchSize={max_rows + 8}",
            f"handler.max_seq_len={max(512, a.prompt + a.new)}", *a.overrides])
        (work / "worker").mkdir(exist_ok=True)
        worker = WorkerGroup(model_dir, work / "worker", device_ids="0" if a.device == "cuda" else None)
        front = Frontend(worker)
        engine = None
        try:
            loading = time.perf_counter()
            worker.start()
            worker.load(front.batch_size, 0 if a.device == "cuda" else -1)
            # The offline engine loads and compiles meanwhile (compiling is host work: the two share the cores).
            engine = offline_engine(model_dir)
            worker.wait_loaded()
            record("worker and offline engine loaded", f"{time.perf_counter() - loading:.0f} s (load, compile, capture)",
                   True)
            front.start()
            api_checks(front.port, "llama")
            levels += served_levels(front.port, "llama", a.clients, a.per_client, a.prompt, a.new)
        except Exception as exc:
            record("serving", f"{type(exc).__name__}: {exc}\n{worker.log_tail()}", False)
        finally:
            front.stop()
            worker.stop()
        if engine is not None:
            try:
                offline.update(offline_rates(engine, a.clients, a.prompt, a.new))
                record("offline engine", ", ".join(f"{c}: {r:.0f}" for c, r in offline.items()) + " tokens/s", True)
            except Exception as exc:
                record("offline engine", f"{type(exc).__name__}: {exc}", False)
    except SystemExit:
        record("stopped", "by SIGTERM (a time limit) before the end", False)
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
        device = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
        print(f"checks.gpu_serve on {device}, torch {torch.__version__}, {time.perf_counter() - started:.0f} s; "
              f"prompt {a.prompt}, {a.new} new tokens, {a.per_client} requests a client")
        print(table(levels, offline))
    return 0 if all(ok for _, _, ok in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
