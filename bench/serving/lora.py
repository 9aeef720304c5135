"""LoRA adapters served (`--scenario lora`, issue 60): a row on an adapter against the base alone, on a
bfloat16 and an int4 base, and ours against vLLM's CPU build with --enable-lora on the same adapters.

    bash bench/setup_vllm.sh                                   # once: bench/out/vllm-venv
    .venv/bin/python -m bench.serving.serve --scenario lora [--servers ours ours-int4 vllm] [--adapters 8]
        [--rank 16] [--concurrency 1 8] [--requests 1] [--rounds 3] [--prompt-len 200] [--new-tokens 64]
    .venv/bin/python -m bench.serving.serve --scenario lora --report bench/out/lora.json   # the tables again

The adapters: --adapters random rank --rank adapters on all seven projections of every layer, in PEFT's
files (bench/lib/lora_adapters.py, written once under bench/out/lora/ and read back by our reader); both
servers load the same folders. Ours: TorchServe with this checkout's handler (levels' servers, prefix
caching off), handler.lora_adapters naming every folder, handler.max_lora_rank --rank and
handler.max_loras --adapters (all resident); "ours-int4" the same with handler.quantize=int4. "vllm":
vLLM's CPU build on the same weights as a Hugging Face folder, in --vllm-dtype (float32: its better dtype
on a CPU without avx512_bf16), with --enable-lora --lora-modules NAME=FOLDER ... --max-lora-rank --rank
--max-loras --adapters. Every server first answers one greedy request on the base and on each adapter
(vLLM loads an adapter at its first request), so loading stays out of the levels, and the tables say how
many greedy tokens the servers agree on.

Per level of C clients (--concurrency), each client sends --requests streaming requests back to back,
prompt --prompt-len token ids (our native API gets their text), --new-tokens each, greedy, stop tokens
ignored; twice: "base" (no adapter named) and "adapters" (client i names adapter i, so 8 clients keep 8
adapters in every decode step; 1 client uses one). TPOT = (latency - TTFT) / (tokens - 1), p50.
All servers start first; then each level runs --rounds times per server and kind, servers and kinds
taking turns (order reversed every round), each turn once all servers are quiet (bench/serving/turns.py).
Prints per server TPOT on adapters / on the base per round against the issue's targets (1.15x at 1
client, 1.3x at 8, ours only), and ours / vLLM output tok/s on adapter requests (target 1.2x); raw:
bench/out/lora.json (--out). The tables are in lora_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import REPO, write_json
from bench.lib.generation import prompt_text
from bench.lib.llamacpp import cpu_flags
from bench.lib.lora_adapters import TARGETS, ensure_adapters
from bench.serving.clients import Send, run_level, torchserve_stream
from bench.serving.levels import median_level, start
from bench.serving.lora_report import report
from bench.serving.servers import keep_levels, printed_report, start_each
from bench.serving.turns import cpu_seconds, settle
from bench.serving.vllm_peer import VLLMServer, vllm_stream
from tests.support.serving_util import TorchServe
from tp_llama.tokenizer import load_tokenizer

SERVERS = ("ours", "ours-int4", "vllm")
KINDS = ("base", "adapters")
Ask = Callable[[str | None, int], dict]  # (adapter, or None for the base; new tokens) -> one timed greedy reply


@dataclass
class Served:
    """A server up and warmed: its request on a given adapter, its process tree, what the JSON keeps of it."""

    ask: Ask
    process: subprocess.Popen | None
    info: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- requests

def asker(server: TorchServe | VLLMServer, text: str, ids: list[int], timeout: float) -> Ask:
    """One streaming greedy request naming the adapter in `model` (vLLM's convention, which ours follows):
    ours gets the prompt's text on its native API, vLLM its ids on /v1/completions."""
    if isinstance(server, TorchServe):
        return lambda model, n: torchserve_stream(server, text, n, timeout, fields={"model": model} if model else {})
    return lambda model, n: vllm_stream(server.port, ids, n, timeout, {"model": model} if model else {})


def one_per_client(names: list[str]) -> Callable[[], str]:
    """The calling client's adapter: the i-th client thread to ask keeps names[i % len(names)] for all its
    requests, so C clients keep C different adapters (up to len(names)) in every step of the level."""
    local, order = threading.local(), itertools.count()

    def name() -> str:
        if not hasattr(local, "name"):
            local.name = names[next(order) % len(names)]
        return local.name

    return name


def level_send(ask: Ask, kind: str, names: list[str]) -> Send:
    """A level's sender: every request on the base, or each client on its own adapter (fresh per level, so
    one client is always on the first adapter and 8 clients on the first 8)."""
    if kind == "base":
        return lambda _prompt, n: ask(None, n)
    pick = one_per_client(names)
    return lambda _prompt, n: ask(pick(), n)


# ---------------------------------------------------------------------------- servers

def levels_args(a: argparse.Namespace, adapters: dict[str, str], name: str) -> argparse.Namespace:
    """What levels' `start` reads, for server `name`: ours with the adapters in its yaml, vLLM in its own
    dtype with them as --lora-modules; both keep every adapter resident (max_loras); greedy on our native API."""
    served = argparse.Namespace(**vars(a), sampling="greedy", api="native", yaml_before=[])
    if name == "vllm":
        lora = ["--enable-lora", "--max-lora-rank", str(a.rank), "--max-loras", str(len(adapters)),
                "--lora-modules", *(f"{n}={path}" for n, path in adapters.items())]
        served.dtype, served.vllm_arg = a.vllm_dtype, lora + a.vllm_arg
    else:
        served.yaml = [f"handler.lora_adapters={json.dumps(adapters)}", f"handler.max_lora_rank={a.rank}",
                       f"handler.max_loras={len(adapters)}", *a.yaml]
    return served


def start_served(name: str, a: argparse.Namespace, adapters: dict[str, str], ids: list[int], text: str,
                 stack: contextlib.ExitStack) -> Served:
    """Server `name` up (levels' start: its base warmed, greedy tokens kept), then one greedy request on
    each adapter, their tokens kept too."""
    info, _, server = start(name, levels_args(a, adapters, name), {"ours": REPO}, ids, text, stack)
    served = Served(asker(server, text, ids, a.timeout), server.process, info)
    info["adapter_tokens"] = {n: served.ask(n, a.check_tokens)["token_ids"] for n in adapters}
    same = sum(tokens == info["first_tokens"] for tokens in info["adapter_tokens"].values())
    print(f"[{name}] answered on {len(adapters)} adapters; {same} of them gave the base's greedy tokens", flush=True)
    return served


# ---------------------------------------------------------------------------- turns

def turn(up: dict[str, Served], name: str, kind: str, clients: int, r: int, names: list[str],
         a: argparse.Namespace) -> dict:
    """One level of one kind on one server, once all are quiet; the CPU the waiting servers used meanwhile kept."""
    waiting = [s.process for n, s in up.items() if n != name]
    settled_s = settle([s.process for s in up.values()])
    idle_before = sum(cpu_seconds(p) for p in waiting)
    level = run_level(level_send(up[name].ask, kind, names), [], clients, a.requests, a.new_tokens)
    level.update(idle_cpu_s=sum(cpu_seconds(p) for p in waiting) - idle_before, round=r, settled_s=settled_s)
    tpot = level.get("tpot_p50_s")
    print(f"[{name}] {kind}, {clients} client(s), round {r + 1}: {level['tokens_per_s']:.1f} tok/s, TPOT p50 "
          f"{1e3 * tpot if tpot else float('nan'):.0f} ms, errors {level['errors']}, the waiting servers' CPU "
          f"{level['idle_cpu_s']:.2f} s", flush=True)
    return level


def taking_turns(up: dict[str, Served], names: list[str], a: argparse.Namespace) -> dict[str, list[dict]]:
    """Each level a.rounds times per server and kind, a server's two kinds back to back, the whole order
    reversed every round; per server and level each kind's median over the rounds (levels' median_level)."""
    order = [(name, kind) for name in up for kind in KINDS]
    out: dict[str, list[dict]] = {name: [] for name in up}
    for clients in a.concurrency:
        runs: dict[tuple[str, str], list[dict]] = {pair: [] for pair in order}
        for r in range(a.rounds):
            for name, kind in order if r % 2 == 0 else order[::-1]:
                runs[name, kind].append(turn(up, name, kind, clients, r, names, a))
        for name in up:
            out[name].append({"clients": clients, **{kind: median_level(runs[name, kind]) for kind in KINDS}})
    return out


# ---------------------------------------------------------------------------- command

def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS),
                        help="ours (bfloat16 by --dtype), ours-int4 (handler.quantize=int4), vllm (--vllm-dtype)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--adapters", type=int, default=8, help="adapters loaded; the largest level should not exceed it")
    parser.add_argument("--rank", type=int, default=16, help="their rank (and both servers' largest rank)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="ours")
    parser.add_argument("--vllm-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--tp", type=int, default=1, help="ranks of our servers")
    parser.add_argument("--omp-threads", type=int, default=2, help="OpenMP threads per rank")
    parser.add_argument("--yaml", action="append", default=[], metavar="KEY=VALUE",
                        help="model-config.yaml override for ours (repeatable)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=1, help="requests per client and kind, back to back")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--check-tokens", type=int, default=16, help="greedy tokens of the warm-up, compared")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vllm-cores", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-max-model-len", type=int, default=1024)
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 and 2 clients, 2 adapters, 1 round, 8 "
                        "new tokens")
    parser.add_argument("--out", default="lora", help="name of the JSON under bench/out/")
    parser.add_argument("--report", type=Path, help="print the tables of an earlier run's JSON")


def run(a: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if printed_report(a.report, report):
        return
    if a.quick:
        a.concurrency, a.adapters, a.rounds, a.new_tokens = [1, 2], 2, 1, 8
    if a.rounds < 1 or a.adapters < 1:
        parser.error("--rounds and --adapters: 1 or more")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through the with-block: servers stopped
    ckpt = ensure_checkpoint(PRESETS[a.preset], mp=a.tp)
    folders = ensure_adapters(ensure_checkpoint(PRESETS[a.preset], mp=1), a.adapters, a.rank)
    adapters = {folder.name: str(folder) for folder in folders}
    text = prompt_text(ckpt, a.prompt_len)
    ids = load_tokenizer(ckpt / "tokenizer.model").encode(text, bos=True, eos=False)
    data: dict = {"preset": a.preset, "dtype": a.dtype, "vllm_dtype": a.vllm_dtype, "tp": a.tp,
                  "omp_threads": a.omp_threads, "prompt_len": len(ids), "new_tokens": a.new_tokens,
                  "requests": a.requests, "concurrency": a.concurrency, "rounds": a.rounds, "rank": a.rank,
                  "modules": list(TARGETS), "adapters": adapters, "check_tokens": a.check_tokens,
                  "vllm_cores": a.vllm_cores, "ckpt": str(ckpt), "cpu_flags": cpu_flags(), "servers": {}, "failed": {}}
    with contextlib.ExitStack() as stack:
        up = start_each(a.servers, lambda name: start_served(name, a, adapters, ids, text, stack), data["failed"])
        keep_levels(data, up, taking_turns(up, list(adapters), a) if up else {})
    path = write_json(a.out, data)
    print(report(json.loads(path.read_text())))
    print(f"raw numbers: {path}")
