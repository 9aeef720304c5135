"""Prefix caching and the paged KV cache (`--scenario prefix`), side by side with vLLM's CPU build (its
prefix caching on).

    .venv/bin/python -m bench.serving.serve --scenario prefix [--preset llama3.2-1b] [--dtype float32 bfloat16]
        [--tp 1] [--omp-threads 2] [--kv-gib 2] [--skip-vllm] [--quick]
    .venv/bin/python -m bench.serving.serve --scenario prefix --report bench/out/bench_prefix.json

One server at a time on the same weights (vLLM gets them converted to a Hugging Face folder),
the same KV-cache memory, the same token ids: every request goes as token ids to
/v1/completions (ours through TorchServe), streamed, greedy, stop tokens ignored.

- system: a shared system prompt (1,024 tokens) + 64 unique tokens, 64 new, at 1/4/16 clients,
  each sending --requests requests back to back; one request warms the system prompt first.
- chat: each client holds a --turns-turn conversation; every turn resends the whole history (the
  earlier turns' prompt and answer ids) plus a new 64-token user message, 64 new tokens. The 5th
  turn's TTFT is compared with a cold prompt as long as it (unique ids, 1 client).
Ours alone:
- real chat: /v1/chat/completions with text messages, the history resent as text (so the server
  re-tokenizes earlier answers): the prefix-cache hit rate, and the turns where the cache stopped
  short of the previous answer's last full block (its text re-encoded to other ids there).
- capacity: the KV memory of 16 sequences of 2,048 positions, 64 clients of 192-token prompts
  and 64 new tokens at once: the most sequences running together and the preemptions (metrics).
Raw numbers: bench/out/bench_prefix.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import shutil
import threading
import time
from pathlib import Path

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import OUT, REPO, machine, table, write_json
from bench.lib.llamacpp import cpu_flags
from bench.serving.clients import in_threads, openai_stream, percentile
from bench.serving.servers import (NAME, archive, git_describe, own_rendezvous, printed_report, start_ready, vllm_folder,
                                   vllm_version)
from bench.serving.vllm_peer import VLLM_VENV, VLLMServer, vllm_stream
from tests.support.serving_util import TorchServe
from tp_llama.testing.tokenizer_train import CORPUS_PATH
from tp_llama.tokenizer import load_tokenizer

WORK = OUT / "bench_prefix"
MAX_LEN = 2048
PER_TOKEN = {"float32": 4, "bfloat16": 2}


class Ids:
    """Token ids of the tokenizer's own corpus, handed out in disjoint runs (unique text per request)."""

    def __init__(self, ckpt: Path):
        self.tokenizer = load_tokenizer(ckpt / "tokenizer.model")
        corpus = self.tokenizer.encode(CORPUS_PATH.read_text(), bos=False)
        self.pool = corpus * (1 + 200_000 // len(corpus))
        self.at = 0
        self.lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        with self.lock:
            self.at = (self.at + 7919) % (len(self.pool) - n)  # a stride prime to the corpus: runs rarely repeat
            return self.pool[self.at : self.at + n]

    def prompt(self, n: int) -> list[int]:
        return [self.tokenizer.bos_id] + self.take(n - 1)


def clients(count: int, work) -> tuple[list[dict], float]:
    """`count` threads running work(client) -> list of replies; all replies and the wall time."""
    replies, errors, lock = [], [], threading.Lock()

    def run(c: int, _: float) -> None:
        try:
            got = work(c)
        except Exception as exc:  # reported with the level
            with lock:
                errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            return
        with lock:
            replies.extend(got)

    wall = in_threads(count, run)
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[:2]}")
    return replies, wall


def summary(replies: list[dict], wall: float) -> dict:
    ttft = sorted(r["ttft_s"] for r in replies)
    prompt = sum(r["prompt_tokens"] for r in replies)
    cached = sum(r["cached_tokens"] or 0 for r in replies)
    return {"requests": len(replies), "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "tokens_per_s": sum(r["tokens"] for r in replies) / wall, "wall_s": wall,
            "hit_rate": cached / prompt if prompt else 0.0}


def system_scenario(send, ids: Ids, a: argparse.Namespace) -> list[dict]:
    system = ids.prompt(a.system_tokens)
    send(system + ids.take(64), 4)  # the system prompt enters the cache
    out = []
    for n in a.system_clients:
        replies, wall = clients(n, lambda c: [send(system + ids.take(64), a.new_tokens) for _ in range(a.requests)])
        out.append({"clients": n, **summary(replies, wall)})
        print(f"  system prompt, {n} client(s): {out[-1]}", flush=True)
    return out


def chat_scenario(send, ids: Ids, a: argparse.Namespace) -> list[dict]:
    out = []
    for n in a.chat_clients:
        def conversation(c: int) -> list[dict]:
            history, turns = ids.prompt(64), []
            for turn in range(a.turns):
                reply = send(history, a.new_tokens)
                turns.append({**reply, "turn": turn + 1})
                history = history + reply["token_ids"] + ids.take(64)
            return turns

        replies, wall = clients(n, conversation)
        last = sorted(r["ttft_s"] for r in replies if r["turn"] == a.turns)
        level = {"clients": n, **summary(replies, wall), "last_turn_ttft_p50_s": percentile(last, 50),
                 "last_turn_prompt_tokens": max(r["prompt_tokens"] for r in replies)}
        cold = [send(ids.prompt(level["last_turn_prompt_tokens"]), a.new_tokens) for _ in range(2)]
        level["cold_ttft_s"] = min(r["ttft_s"] for r in cold)
        out.append(level)
        print(f"  chat, {n} client(s): {level}", flush=True)
    return out


def chat_text(server: TorchServe, message: list[dict], a: argparse.Namespace, ids: Ids) -> dict:
    """One conversation through /v1/chat/completions in text; hit rate and re-encoding divergences."""
    tokenizer = ids.tokenizer
    conn_headers = {"Content-Type": "application/json", "Authorization": f"Bearer {server.keys()['inference']}"}
    messages = list(message)
    prompt_total = cached_total = diverged = 0
    previous = None  # (prompt tokens, completion tokens) of the turn before
    for _ in range(a.turns):
        body = {"messages": messages, "max_tokens": a.new_tokens, "temperature": 0, "ignore_eos": True}
        conn = http.client.HTTPConnection("127.0.0.1", server.inference_port, timeout=600)
        conn.request("POST", f"/predictions/{NAME}/1.0/v1/chat/completions", body=json.dumps(body).encode(),
                     headers=conn_headers)
        reply = json.loads(conn.getresponse().read())
        conn.close()
        usage = reply["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        prompt_total += usage["prompt_tokens"]
        cached_total += cached
        if previous is not None:  # the cache holds the last turn's prompt and answer but its newest token
            reachable = (previous[0] + previous[1] - 1) // a.block_size * a.block_size
            diverged += cached < reachable
        previous = (usage["prompt_tokens"], usage["completion_tokens"])
        answer = reply["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": tokenizer.decode(ids.take(48))}]
    return {"prompt_tokens": prompt_total, "cached_tokens": cached_total, "diverged_turns": diverged}


def capacity(server: TorchServe, ids: Ids, a: argparse.Namespace) -> dict:
    """64 clients at once; the running-sequences gauge sampled while they run."""
    auth = {"Authorization": f"Bearer {server.keys()['inference']}"}
    path = f"/predictions/{NAME}/1.0/v1/completions"
    peak, done = {"running": 0.0, "blocks": 0.0}, threading.Event()

    def watch() -> None:
        while not done.is_set():
            body = server.request("GET", "/metrics", port=server.metrics_port, key=None, timeout=30).body.decode()
            for key, name in (("running", "llama_running_sequences"), ("blocks", "llama_kv_cache_blocks_used")):
                for value in re.findall(rf"^{name}\{{.*?\}} (\S+)$", body, re.M):
                    peak[key] = max(peak[key], float(value))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    replies, wall = clients(64, lambda c: [openai_stream(server.inference_port, path, ids.prompt(192), a.new_tokens,
                                                         auth, {}, 900)])
    done.set()
    watcher.join()
    body = server.request("GET", "/metrics", port=server.metrics_port, key=None, timeout=30).body.decode()
    preempted = sum(float(v) for v in re.findall(r"^llama_preemptions_total\{.*?\} (\S+)$", body, re.M))
    return {"clients": 64, **summary(replies, wall), "peak_running": peak["running"], "peak_blocks": peak["blocks"],
            "preemptions": preempted}


def measure_ours(ckpt: Path, dtype: str, a: argparse.Namespace, ids: Ids, kv_gb: float, scenarios: bool) -> dict:
    work = WORK / f"ours-{dtype}"
    shutil.rmtree(work, ignore_errors=True)
    overrides = [own_rendezvous(), f"torchrun.OMP_NUMBER_THREADS={a.omp_threads}",
                 f"handler.dtype={dtype}", f"handler.max_seq_len={MAX_LEN}", f"handler.kv_cache_memory_gb={kv_gb}",
                 "handler.max_batch_size=64", "batchSize=80", "maxBatchDelay=5", "responseTimeout=900"]
    folder = archive(REPO, ckpt, work / "model_store", a.tp, overrides)
    result: dict = {"overrides": overrides, "commit": git_describe(REPO)}
    with TorchServe(work, folder.parent, NAME) as server:
        result["ready_s"] = start_ready(server)
        auth = {"Authorization": f"Bearer {server.keys()['inference']}"}
        path = f"/predictions/{NAME}/1.0/v1/completions"

        def send(prompt: list[int], n: int) -> dict:
            return openai_stream(server.inference_port, path, prompt, n, auth, {"return_token_ids": True}, 900)

        print(f"[ours {dtype}] ready after {result['ready_s']:.0f} s", flush=True)
        if scenarios:
            result["system"] = system_scenario(send, ids, a)
            result["chat"] = chat_scenario(send, ids, a)
            first = [{"role": "system", "content": ids.tokenizer.decode(ids.take(200))},
                     {"role": "user", "content": ids.tokenizer.decode(ids.take(64))}]
            result["chat_text"] = chat_text(server, first, a, ids)
            print(f"  real chat: {result['chat_text']}", flush=True)
        else:
            result["capacity"] = capacity(server, ids, a)
            print(f"  capacity: {result['capacity']}", flush=True)
        result["stop"] = server.stop()
    return result


def measure_vllm(ckpt: Path, dtype: str, a: argparse.Namespace, ids: Ids) -> dict:
    work = WORK / f"vllm-{dtype}"
    hf_dir, port = vllm_folder(ckpt, work, MAX_LEN)
    result: dict = {"version": vllm_version(), "venv": str(VLLM_VENV)}
    with VLLMServer(hf_dir, port, work, dtype, MAX_LEN, cores=a.vllm_cores, kv_gib=a.kv_gib, prefix_caching=True,
                    extra_args=["--enable-prompt-tokens-details"]) as server:
        server.start()
        result["ready_s"] = server.wait_ready(timeout=900)
        print(f"[vllm {dtype}] ready after {result['ready_s']:.0f} s", flush=True)
        send = lambda prompt, n: vllm_stream(port, prompt, n, 900)  # noqa: E731
        result["system"] = system_scenario(send, ids, a)
        result["chat"] = chat_scenario(send, ids, a)
        result["stop_returncode"] = server.stop()
    return result


def report(data: dict) -> str:
    lines = [f"CPU: {data['machine'].get('cpu')} ({data['flags']}); model {data['preset']}; "
             f"ours TP {data['tp']} x {data['omp_threads']} threads; KV memory {data['kv_gib']} GiB each"]
    for dtype, runs in data["runs"].items():
        ours, vllm = runs.get("ours", {}), runs.get("vllm", {})
        rows = []
        for scenario in ("system", "chat"):
            for mine in ours.get(scenario, []):
                peer = next((p for p in vllm.get(scenario, []) if p["clients"] == mine["clients"]), None)
                row = [scenario, mine["clients"], f"{mine['ttft_p50_s']:.3f}", f"{mine['tokens_per_s']:.1f}",
                       f"{mine['hit_rate']:.0%}"]
                if peer:
                    row += [f"{peer['ttft_p50_s']:.3f}", f"{peer['tokens_per_s']:.1f}", f"{peer['hit_rate']:.0%}",
                            f"{mine['ttft_p50_s'] / peer['ttft_p50_s']:.2f}x",
                            f"{mine['tokens_per_s'] / peer['tokens_per_s']:.2f}x"]
                else:
                    row += ["-"] * 5
                if scenario == "chat":
                    row.append(f"5th turn {mine['last_turn_ttft_p50_s']:.3f} s vs cold {mine['cold_ttft_s']:.3f} s "
                               f"({mine['last_turn_ttft_p50_s'] / mine['cold_ttft_s']:.2f}x)")
                else:
                    row.append("")
                rows.append(row)
        lines.append(f"\n{dtype}\n" + table(
            ["scenario", "clients", "TTFT p50 ours (s)", "tok/s ours", "hits ours", "TTFT p50 vLLM (s)",
             "tok/s vLLM", "hits vLLM", "TTFT ours/vLLM", "tok/s ours/vLLM", ""], rows))
        if "chat_text" in ours:
            t = ours["chat_text"]
            lines.append(f"real chat (text, /v1/chat/completions): {t['cached_tokens']}/{t['prompt_tokens']} prompt "
                         f"tokens from the cache ({t['cached_tokens'] / t['prompt_tokens']:.0%}); re-encoded answers "
                         f"diverged before their last full block in {t['diverged_turns']} of {data['turns'] - 1} turns")
        if "capacity" in runs:
            c = runs["capacity"]["capacity"]
            lines.append(f"capacity (KV memory of 16 x 2048 positions): 64 clients, peak running {c['peak_running']:.0f}, "
                         f"peak blocks {c['peak_blocks']:.0f}, preemptions {c['preemptions']:.0f}, "
                         f"{c['tokens_per_s']:.1f} tok/s")
    return "\n".join(lines)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama3.2-1b", choices=sorted(PRESETS))
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=sorted(PER_TOKEN))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--omp-threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=2, help="KV-cache memory of each server")
    parser.add_argument("--vllm-cores", default="0-1")
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--system-clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--chat-clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16, help="ours (the yaml's kv_block_size)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a 256-token system prompt, 1 and 4 clients, 3 turns")
    parser.add_argument("--report", type=Path, help="print the tables of an earlier run's JSON")


def run(a: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if printed_report(a.report, report):
        return
    if a.quick:
        a.system_tokens, a.system_clients, a.chat_clients, a.turns, a.requests = 256, [1, 4], [1], 3, 1
    shape = PRESETS[a.preset]
    ckpt = ensure_checkpoint(shape, 1)
    ids = Ids(ckpt)
    data = {"machine": machine(), "flags": " ".join(cpu_flags()), "preset": a.preset, "tp": a.tp, "omp_threads": a.omp_threads, "kv_gib": a.kv_gib,
            "turns": a.turns, "args": vars(a) | {"report": None}, "runs": {}}
    for dtype in a.dtype:
        runs = data["runs"][dtype] = {}
        runs["ours"] = measure_ours(ckpt, dtype, a, ids, a.kv_gib, scenarios=True)
        if not a.skip_vllm:
            runs["vllm"] = measure_vllm(ckpt, dtype, a, ids)
        if not a.skip_capacity:
            token_bytes = 2 * shape.n_layers * shape.n_kv_heads * (shape.dim // shape.n_heads) * PER_TOKEN[dtype]
            runs["capacity"] = measure_ours(ckpt, dtype, a, ids, 16 * MAX_LEN * token_bytes / 2**30, scenarios=False)
        write_json("bench_prefix", data)
    print(report(data))

