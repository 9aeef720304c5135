"""Speculative decoding served: ours through TorchServe against llama.cpp's llama-server at each of its
speculation settings, on SmolLM2-135M-Instruct, at 1, 4 and 16 clients.

    bash bench/setup_llamacpp.sh                        # once: bench/out/llama.cpp
    python -m bench.lib.smollm2 convert --gguf          # once: the checkpoint and its F32 GGUF
    python -m bench.serving.speculative [--clients 1 4 16] [--rounds 3] [--new-tokens 128]
        [--per-client 4] [--ours off ngram] [--llama none ngram-simple ngram-mod draft-simple]

The committed prompt set (bench/engine/speculative_prompts.json: replies that copy from their prompt,
and free chat) in SmolLM2's chat format, as token ids made by its own tokenizer, goes to every server,
greedy, up to --new-tokens, ending at <|im_end|> (ours: the stop string, the token our conversion
decodes to that text; llama-server: the GGUF's end-of-generation token). Servers taking turns, one at a
time, for --rounds rounds (the order reversed every round): ours bfloat16 at TP 1 without speculation and
with n-gram lookup, both started once (prefix caching off: every round sends the same prompts; `--ours` may add
either with `-within-calls`: handler.step_between_calls false); llama-server on the BF16 GGUF of the same
weights with no speculation, `--spec-type ngram-simple`, `ngram-mod`, and `draft-simple` with the Q4_0
GGUF drafting, prompt caching off, both on this machine's threads, a fresh llama-server each round (so
ngram-mod's table never holds the replies to the prompts it is sent) with a slot a client. At C clients a
round of a kind is max(C x --per-client, its prompts) requests, the prompts in turn, C at a time (closed
loop: with one wave the slowest reply would set the time); output
tokens/s = the round's tokens over its seconds; the median over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.engine.speculative import PROMPTS, round_prompts
from bench.lib import llamacpp
from bench.lib.common import OUT, REPO, table
from bench.lib.smollm2 import chat_ids
from bench.serving.clients import openai_stream
from bench.serving.llamacpp_peer import LlamaServer, llamacpp_stream, version
from bench.serving.servers import NAME, archive, own_rendezvous, start_ready
from tests.support.serving_util import TorchServe, free_ports

WORK = OUT / "serving-speculative"
LLAMA_SETTINGS = {"none": [], "ngram-simple": ["--spec-type", "ngram-simple"], "ngram-mod": ["--spec-type", "ngram-mod"],
                  "draft-simple": ["--spec-type", "draft-simple", "-md", "DRAFT"]}


def round_rate(send: Callable[[list[int]], dict], prompts: list[list[int]], clients: int, per_client: int) -> float:
    """Output tokens/s of one round: its requests (round_prompts), `clients` at a time."""
    requests = round_prompts(prompts, clients, per_client)
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        replies = list(pool.map(send, requests))
    return sum(r["tokens"] for r in replies) / (time.perf_counter() - started)


def medians(per_round: dict[tuple[str, int], list[float]]) -> dict[tuple[str, int], float]:
    out = {key: statistics.median(rates) for key, rates in per_round.items()}
    for (kind, clients), rates in per_round.items():
        print(f"  {kind} x{clients}: {out[kind, clients]:.1f} tok/s (rounds {' '.join(f'{r:.0f}' for r in rates)})",
              flush=True)
    return out


OURS = ("off", "ngram", "off-within-calls", "ngram-within-calls")


def ours(variant: str, a: argparse.Namespace) -> tuple[TorchServe, Callable[[list[int]], dict]]:
    """Our server as `variant` names it (OURS), started, and how to send it a prompt."""
    work = WORK / f"ours-{variant}"
    shutil.rmtree(work, ignore_errors=True)
    speculative, _, within = variant.partition("-")
    overrides = [own_rendezvous(), "handler.dtype=bfloat16", f'handler.speculative="{speculative}"',
                 "handler.prefix_caching=false", "handler.max_seq_len=1024",
                 f"handler.step_between_calls={'false' if within else 'true'}"]
    folder = archive(REPO, a.ckpt, work / "model_store", 1, overrides)
    server = TorchServe(work, folder.parent, NAME)
    start_ready(server)
    auth = {"Authorization": f"Bearer {server.keys()['inference']}"}
    path, stop = f"/predictions/{NAME}/1.0/v1/completions", {"ignore_eos": False, "stop": ["<|im_end|>"]}
    return server, lambda ids: openai_stream(server.inference_port, path, ids, a.new_tokens, auth, stop)


def llama_round(setting: str, kinds: dict, a: argparse.Namespace, round_: int) -> dict[tuple[str, int], float]:
    """One round on llama-server, a fresh one for each client count: its ngram-mod keeps one n-gram table
    across requests, so prompts sent again would be answered from replies it has already seen, which a new
    prompt never is. Within a round it still learns from the round's earlier prompts and replies, as it
    would serving."""
    extra = [str(a.ckpt / "model-q4_0.gguf") if arg == "DRAFT" else arg for arg in LLAMA_SETTINGS[setting]]
    out = {}
    for clients in a.clients:
        port = free_ports(1)[0]
        with LlamaServer(a.ckpt / "model-bf16.gguf", port, WORK / f"llama-{setting}-{round_}-{clients}", clients,
                         2048, a.threads, extra) as server:
            server.start()
            server.wait_ready(timeout=300)
            for kind, prompts in kinds.items():
                out[kind, clients] = round_rate(
                    lambda ids: llamacpp_stream(port, ids, a.new_tokens, fields={"ignore_eos": False}), prompts, clients,
                    a.per_client)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=OUT / "smollm2" / "plain")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--per-client", type=int, default=4, help="requests a client sends in a round (1: one wave)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ours", nargs="+", choices=OURS, default=["off", "ngram"])
    parser.add_argument("--llama", nargs="*", choices=list(LLAMA_SETTINGS), default=list(LLAMA_SETTINGS),
                        help="llama-server's settings to run (none of them: ours alone)")
    a = parser.parse_args(argv)
    for kind, dst in (("BF16", "model-bf16.gguf"), ("Q4_0", "model-q4_0.gguf")):
        llamacpp.quantize(a.ckpt / "model-f32.gguf", a.ckpt / dst, kind, threads=a.threads)
    sets = json.loads(PROMPTS.read_text())
    kinds = {kind: [chat_ids([{"role": "user", "content": text}]) for text in sets[kind]] for kind in ("copy", "chat")}
    names = [*(f"ours {variant}" for variant in a.ours), *(f"llama-server {setting}" for setting in a.llama)]
    per_round: dict[str, dict[tuple[str, int], list[float]]] = {name: {} for name in names}
    with contextlib.ExitStack() as stack:
        sends = {}
        for variant in a.ours:
            server, sends[f"ours {variant}"] = ours(variant, a)
            stack.callback(server.stop)
        for round_ in range(a.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                print(f"round {round_ + 1}: {name}", flush=True)
                try:
                    if name in sends:
                        got = {(kind, c): round_rate(sends[name], prompts, c, a.per_client) for c in a.clients
                               for kind, prompts in kinds.items()}
                    else:
                        got = llama_round(name.split()[-1], kinds, a, round_)
                except (RuntimeError, TimeoutError) as exc:  # a setting this build refuses: the table goes on
                    print(f"  failed: {str(exc)[-400:]}", flush=True)
                    continue
                for key, rate in got.items():
                    per_round[name].setdefault(key, []).append(rate)
    results = {}
    for name, rounds in per_round.items():
        if rounds:
            print(name, flush=True)
            results[name] = medians(rounds)
    levels = [(kind, c) for c in a.clients for kind in kinds]
    peers = [r for name, r in results.items() if name.startswith("llama")] or [results[f"ours {a.ours[0]}"]]
    best = {key: max(r[key] for r in peers) for key in levels}
    rows = [[name, clients, *(r[kind, clients] for kind in kinds), *(r[kind, clients] / best[kind, clients] for kind in kinds)]
            for clients in a.clients for name, r in results.items()]
    against = "llama-server's best" if a.llama else f"ours {a.ours[0]}"
    print(table(["server", "clients", *[f"{k} tok/s" for k in kinds], *[f"{k} / {against}" for k in kinds]], rows))
    print(f"\nSmolLM2-135M-Instruct, greedy, up to {a.new_tokens} tokens, medians of {a.rounds} rounds; "
          f"llama.cpp {version()}, {a.threads} threads.")


if __name__ == "__main__":
    main()
