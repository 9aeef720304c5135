"""Speculative decoding on real weights: ours with proposals against ours without, taking turns.

    python -m bench.engine.speculative [--ckpt DIR] [--clients 1 4 16] [--rounds 5] [--new-tokens 128]
                                       [--dtype bfloat16] [--speculative-tokens 4] [--ngram 2 4]
                                       [--proposer ngram|draft] [--draft DIR]

The offline engine, TP 1, every core; SmolLM2-135M-Instruct converted to Meta's layout by default
(`python -m bench.lib.smollm2 convert`). The prompt set, bench/engine/speculative_prompts.json
(written before measuring): replies that copy from their prompt (an edit of this repository's code,
a passage of the test corpus quoted and summarised, a form filled in, a typo fixed) and free chat, in
SmolLM2's chat format with its own tokenizer (bench.lib.smollm2.chat_ids), greedy, ending at
<|im_end|>. For each kind and client count, max(clients x --per-client, prompts) requests (the kind's
prompts in turn), `clients` at a time in a closed loop (each finished request followed at once by the
next; with one wave of requests the slowest reply sets its time, and speculation speeds rows unevenly),
tokens/s counted while `clients` requests run (to the first that finds no request left: `run`),
run with proposals and without, the two taking turns for --rounds rounds. The table: output
tokens/s of each (median of the rounds), their ratio, the share of proposals accepted, and the
replies' distinct-4-gram ratio, one reply a prompt (a looping reply shows). One speculator serves
the whole run, as a server's scheduler keeps one: its fit of the step cost carries over.
Replies with and without proposals are checked to be the same.

--proposer draft: a draft model proposes, --draft DIR or by default the checkpoint itself at int4
(its rotated conversion, `convert --rotate 1`: the plain one sits on a 4-bit grid). At one client the
table then adds the speedup predicted from the acceptance, the prompts' share of the plain runs'
seconds (not sped up) and the step costs (bench/engine/draft_costs.py), all measured, beside the
measured one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.engine.draft_costs import predicted_speedup, step_costs
from bench.lib.common import OUT, table
from bench.lib.smollm2 import IM_END, chat_ids
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.engine.speculate import Speculator

PROMPTS = Path(__file__).with_name("speculative_prompts.json")


def distinct_4grams(replies: list[list[int]]) -> float:
    """Distinct 4-grams over all 4-grams of the replies (1.0: none repeats)."""
    grams = [tuple(r[i : i + 4]) for r in replies for i in range(len(r) - 3)]
    return len(set(grams)) / max(len(grams), 1)


def round_prompts(prompts: list[list[int]], clients: int, per_client: int) -> list[list[int]]:
    """A round's requests: max(clients x per_client, prompts) of them, the prompts in turn (this bench's
    and bench/serving/speculative.py's)."""
    return [prompts[i % len(prompts)] for i in range(max(clients * per_client, len(prompts)))]


def run(engine: Engine, prompts: list[list[int]], clients: int, new: int, speculator: Speculator | None,
        per_client: int = 1) -> tuple[float, list[list[int]]]:
    """(output tokens/s, replies) of a round's requests (round_prompts), `clients` at a time: a closed loop,
    each finished request followed at once by the next. The rate counts the tokens made while `clients`
    requests ran, up to the first that found none left to follow it: after that a round's last replies
    run in fewer rows, and that tail lasts longer the less the clients keep in step (replies the same
    length keep them in step without proposals, not with them)."""
    seqs = [Sequence(str(i), ids, SamplingParams(new)) for i, ids in enumerate(round_prompts(prompts, clients, per_client))]
    waiting = iter(seqs[clients:])
    scheduler = engine.new_scheduler()
    scheduler.stop_ids, scheduler.speculator = frozenset({IM_END}), speculator
    for seq in seqs[:clients]:
        scheduler.add(seq)

    window: list[float] = []  # tokens and seconds up to the first finished request with none to follow it

    def follow(touched: list[Sequence]) -> None:
        for _ in range(sum(seq.finished for seq in touched)):
            following = next(waiting, None)
            if following is not None:
                scheduler.add(following)
            elif not window:
                window.extend([sum(len(s.output) for s in seqs), time.perf_counter() - started])

    started = time.perf_counter()
    engine.run(scheduler, on_step=follow)
    tokens, seconds = window or [sum(len(s.output) for s in seqs), time.perf_counter() - started]
    return tokens / seconds, [s.output for s in seqs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default=str(OUT / "smollm2" / "plain"))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--per-client", type=int, default=4,
                        help="requests a client sends in a round, one after another (1: all at once, one wave)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--ngram", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"))
    parser.add_argument("--proposer", choices=["ngram", "draft"], default="ngram")
    parser.add_argument("--draft", default=None, help="the draft's checkpoint (default: --ckpt at int4)")
    a = parser.parse_args(argv)
    sets = json.loads(PROMPTS.read_text())
    kinds = {kind: [chat_ids([{"role": "user", "content": text}]) for text in sets[kind]] for kind in ("copy", "chat")}
    longest = max(len(ids) for prompts in kinds.values() for ids in prompts) + a.new_tokens
    engine = Engine.load(EngineConfig(a.ckpt, "tp", a.dtype, max_seq_len=longest + 8, max_batch_size=max(a.clients),
                                      prefill_budget=1024, speculative=a.proposer, speculative_tokens=a.speculative_tokens,
                                      ngram_min=a.ngram[0], ngram_max=a.ngram[1], draft_ckpt_dir=a.draft))
    run(engine, kinds["chat"][:1], 1, 8, None)  # warm-up
    speculator = engine.new_scheduler().speculator  # one for the whole run, as a server keeps one
    rows = []
    for kind, prompts in kinds.items():
        for clients in a.clients:
            rates, prefill = {"off": [], "on": []}, []  # prefill: its share of each plain run's seconds
            before = (speculator.proposed, speculator.accepted, speculator.verified)
            for _ in range(a.rounds):
                prefill_s = engine.stats.prefill_s
                plain_rate, plain = run(engine, prompts, clients, a.new_tokens, None, a.per_client)
                prefill.append((engine.stats.prefill_s - prefill_s) * plain_rate / sum(map(len, plain)))
                rate, replies = run(engine, prompts, clients, a.new_tokens, speculator, a.per_client)
                if replies != plain:
                    raise SystemExit(f"{kind} at {clients} clients: replies differ with speculation")
                rates["off"].append(plain_rate)
                rates["on"].append(rate)
            off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
            proposed, accepted = speculator.proposed - before[0], speculator.accepted - before[1]
            verified = max(speculator.verified - before[2], 1)
            predicted = "-"
            if a.proposer == "draft" and clients == 1:  # tokens and proposals a verify step, as measured
                costs, share = step_costs(engine, a.speculative_tokens), statistics.median(prefill)
                decode = predicted_speedup((accepted + verified) / verified, proposed / verified, (1 - share) / off, costs)
                predicted = 1 / (share + (1 - share) / decode)  # prefill is not sped up
            rows.append([kind, clients, off, on, on / off, predicted, accepted / max(proposed, 1), proposed,
                         distinct_4grams(plain[: len(prompts)]), " ".join(f"{r:.0f}" for r in rates["off"]),
                         " ".join(f"{r:.0f}" for r in rates["on"])])
            print(f"{kind} x{clients}: off {off:.0f} tok/s, on {on:.0f} tok/s ({on / off:.2f}x), "
                  f"accepted {accepted / max(proposed, 1):.0%}", flush=True)
    print(table(["prompts", "clients", "off tok/s", "on tok/s", "on / off", "predicted", "accepted", "proposed (all rounds)",
                 "distinct 4-grams", "off rounds", "on rounds"], rows))
    proposer = f"n-grams {a.ngram[0]}..{a.ngram[1]}" if a.proposer == "ngram" else f"draft {a.draft or 'int4 self'}"
    print(f"\n{a.ckpt}, {a.dtype}, TP 1, {torch.get_num_threads()} threads; greedy, up to {a.new_tokens} new tokens, "
          f"{a.speculative_tokens} proposals a row, {proposer}; medians of {a.rounds} rounds "
          "taking turns; replies equal with and without proposals in every round.")


if __name__ == "__main__":
    main()
