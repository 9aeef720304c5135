"""Speculative decoding served: ours through TorchServe against llama.cpp's llama-server at each of its
speculation settings, on SmolLM2-135M-Instruct, one client.

    bash bench/setup_llamacpp.sh                        # once: bench/out/llama.cpp
    python -m bench.lib.smollm2 convert --gguf          # once: the checkpoint and its F32 GGUF
    python -m bench.serving.speculative [--rounds 3] [--new-tokens 128]

The committed prompt set (bench/engine/speculative_prompts.json: replies that copy from their prompt,
and free chat) in SmolLM2's chat format, as token ids made by its own tokenizer, goes to every server,
greedy, up to --new-tokens, ending at <|im_end|> (ours: the stop string, the token our conversion
decodes to that text; llama-server: the GGUF's end-of-generation token). Servers, one at a time, each
for --rounds rounds of every prompt: ours bfloat16 at TP 1 without speculation and with n-gram lookup
(prefix caching off: every round sends the same prompts); llama-server on the BF16 GGUF of the same
weights with no speculation, `--spec-type ngram-simple`, `ngram-mod`, and `draft-simple` with the Q4_0
GGUF drafting, prompt caching off, both on this machine's threads, a fresh llama-server each round (so
ngram-mod's table never holds the replies to the prompts it is sent). Output tokens/s = a kind's tokens
over its requests' seconds; the median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path

from bench.engine.speculative import PROMPTS
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


def round_rate(send: Callable[[list[int]], dict], prompts: list[list[int]]) -> float:
    """Output tokens/s of one round: the prompts one after another, their tokens over their seconds."""
    replies = [send(ids) for ids in prompts]
    return sum(r["tokens"] for r in replies) / sum(r["latency_s"] for r in replies)


def medians(per_round: dict[str, list[float]]) -> dict[str, float]:
    out = {kind: statistics.median(rates) for kind, rates in per_round.items()}
    for kind, rates in per_round.items():
        print(f"  {kind}: {out[kind]:.1f} tok/s (rounds {' '.join(f'{r:.0f}' for r in rates)})", flush=True)
    return out


def rates(send: Callable[[list[int]], dict], kinds: dict[str, list[list[int]]], rounds: int) -> dict[str, float]:
    """Each kind's median output tokens/s over the rounds, on one server."""
    return medians({kind: [round_rate(send, prompts) for _ in range(rounds)] for kind, prompts in kinds.items()})


def ours(speculative: str, kinds: dict, a: argparse.Namespace) -> dict[str, float]:
    work = WORK / f"ours-{speculative}"
    shutil.rmtree(work, ignore_errors=True)
    overrides = [own_rendezvous(), "handler.dtype=bfloat16", f'handler.speculative="{speculative}"',
                 "handler.prefix_caching=false", "handler.max_seq_len=1024"]
    folder = archive(REPO, a.ckpt, work / "model_store", 1, overrides)
    server = TorchServe(work, folder.parent, NAME)
    start_ready(server)
    try:
        auth = {"Authorization": f"Bearer {server.keys()['inference']}"}
        path, stop = f"/predictions/{NAME}/1.0/v1/completions", {"ignore_eos": False, "stop": ["<|im_end|>"]}
        return rates(lambda ids: openai_stream(server.inference_port, path, ids, a.new_tokens, auth, stop), kinds,
                     a.rounds)
    finally:
        server.stop()


def llama(setting: str, kinds: dict, a: argparse.Namespace) -> dict[str, float]:
    """A fresh llama-server each round: its ngram-mod keeps one n-gram table across requests, so prompts sent
    again would be answered from replies it has already seen, which a new prompt never is. Within a round it
    still learns from the round's earlier prompts and replies, as it would serving."""
    extra = [str(a.ckpt / "model-q4_0.gguf") if arg == "DRAFT" else arg for arg in LLAMA_SETTINGS[setting]]
    per_round: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(a.rounds):
        port = free_ports(1)[0]
        with LlamaServer(a.ckpt / "model-bf16.gguf", port, WORK / f"llama-{setting}-{round_}", 1, 2048, a.threads,
                         extra) as server:
            server.start()
            server.wait_ready(timeout=300)
            for kind, prompts in kinds.items():
                per_round[kind].append(round_rate(
                    lambda ids: llamacpp_stream(port, ids, a.new_tokens, fields={"ignore_eos": False}), prompts))
    return medians(per_round)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=OUT / "smollm2" / "plain")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args(argv)
    for kind, dst in (("BF16", "model-bf16.gguf"), ("Q4_0", "model-q4_0.gguf")):
        llamacpp.quantize(a.ckpt / "model-f32.gguf", a.ckpt / dst, kind, threads=a.threads)
    sets = json.loads(PROMPTS.read_text())
    kinds = {kind: [chat_ids([{"role": "user", "content": text}]) for text in sets[kind]] for kind in ("copy", "chat")}
    results = {}
    for speculative in ("off", "ngram"):
        print(f"ours, speculative {speculative}", flush=True)
        results[f"ours {speculative}"] = ours(speculative, kinds, a)
    for setting in LLAMA_SETTINGS:
        print(f"llama-server, {setting}", flush=True)
        try:
            results[f"llama-server {setting}"] = llama(setting, kinds, a)
        except (RuntimeError, TimeoutError) as exc:  # a setting this build refuses: the table goes on without it
            print(f"  failed: {str(exc)[-400:]}", flush=True)
    best = {kind: max(r[kind] for name, r in results.items() if name.startswith("llama")) for kind in kinds}
    rows = [[name, *(r[k] for k in kinds), *(r[k] / best[k] for k in kinds)] for name, r in results.items()]
    print(table(["server", *[f"{k} tok/s" for k in kinds], *[f"{k} / llama-server's best" for k in kinds]], rows))
    print(f"\nSmolLM2-135M-Instruct, 1 client, greedy, up to {a.new_tokens} tokens, medians of {a.rounds} rounds; "
          f"llama.cpp {version()}, {a.threads} threads.")


if __name__ == "__main__":
    main()
