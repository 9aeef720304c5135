"""Structured outputs served: what a JSON-schema constraint costs our server, against vLLM's structured
outputs on the same random weights (issue 47, "Cost").

    bash bench/setup_vllm.sh                                   # once: bench/out/vllm-venv
    .venv/bin/python -m bench.serving.structured [--servers ours vllm-float32] [--concurrency 1 8]
        [--requests 4] [--sampling seeded|greedy] [--rounds 3] [--dtype bfloat16] [--quick]
    .venv/bin/python -m bench.serving.structured --report bench/out/structured.json   # the tables again

Servers: "ours" is TorchServe with this checkout's handler (deploy/make_archive), the --preset
checkpoint (default llama3.2-1b: its exact shape and Meta's real tokenizer, 128,256 ids), TP --tp of
--omp-threads threads, --dtype, prefix caching off (every request sends one prompt). "vllm-float32" and
"vllm-bfloat16" are vLLM's CPU build on the same weights (bench/serving/vllm_peer.py) in that dtype,
with Meta's tokenizer.model written as Hugging Face tokenizer files (vllm_peer `tokenizer`): vLLM
compiles structured outputs over its own tokenizer, so this scenario starts it with `--tokenizer`
rather than --skip-tokenizer-init. Before measuring, vLLM's /tokenize of the prompt text must equal our
ids (BOS included) and its /detokenize of them our text. Its structured-output backend is --vllm-backend
(default xgrammar, which "auto" picks for every schema of the corpus) with disable_any_whitespace, as our
replies are compact: with free whitespace random weights pad a reply with blanks until max_tokens
(--vllm-any-whitespace shows it; vLLM allows the compact form only with a backend named). Compact
differs a little: ours writes ", " and ": " between items, xgrammar "," and ":".

Requests: /v1/completions on both, streamed, the same --prompt-len prompt token ids, top_p 1;
--sampling seeded (temperature 1, request k seeded k + 1: random weights at temperature 1, as the tests
run) or greedy. Per level of C clients, each sends --requests back to back, twice:
- constrained: response_format json_schema, request k on schema k mod 8 of the tests' corpus
  (tests/support/schemas.py: bounded, so every reply must end), max_tokens --max-tokens; each reply is
  validated against its schema (jsonschema, formats checked) and the invalid ones counted per server;
- unconstrained: the same requests without response_format, ignore_eos, max_tokens --new-tokens.
Each server first answers every schema once (greedy, compiling and caching its grammars), so compile
time stays out of the levels (bench/kernels/masks.py times compiles and masks alone).

Output tok/s = output tokens / the level's wall time; TTFT = first streamed chunk; TPOT = (latency -
TTFT) / (tokens - 1), p50. Constrained replies are short and vary, so set --new-tokens near their
mean length (printed) for a like-for-like TPOT: shorter replies put more prompt steps among the decode
steps.

One server at a time, or with --rounds R all up at once (memory permitting), taking turns R times per
level (order reversed every round, the two kinds of request too), each turn once all servers are quiet
(bench/serving/turns.py). Prints per server and level the two kinds side by side (tok/s, TTFT, TPOT,
their TPOT ratio, invalid replies, finish reasons) and ours / vLLM per round, with the CPU's flags.
Raw: bench/out/structured.json (--out). The requests are in structured_requests.py, the tables in
structured_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import signal
import statistics
import sys
from collections import Counter

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import OUT, REPO, write_json
from bench.lib.generation import prompt_text
from bench.lib.llamacpp import cpu_flags
from bench.serving.servers import (NAME, archive, git_describe, keep_levels, own_rendezvous, start_each, start_ready,
                                   vllm_folder, vllm_version)
from bench.serving.structured_report import report
from bench.serving.clients import post_json
from bench.serving.structured_requests import MODES, Target, completion, constrained_body, invalid, run_mode
from bench.serving.turns import cpu_seconds, settle
from bench.serving.vllm_peer import SERVED_NAME, VLLM_VENV, VLLMServer, tokenizer_in_venv
from tests.support.schemas import NAMES, SCHEMAS
from tests.support.serving_util import TorchServe
from tp_llama.tokenizer import load_tokenizer

WORK = OUT / "structured"
SERVERS = ("ours", "vllm-float32", "vllm-bfloat16")


# ---------------------------------------------------------------------------- servers

def warm(label: str, target: Target, ids: list[int], a: argparse.Namespace) -> dict:
    """Each schema once, greedy (compiling and caching its grammar), and one unconstrained request."""
    replies = [completion(target, {"prompt": ids, "temperature": 0.0, **constrained_body(i, a.max_tokens)}, a.timeout)
               for i in range(len(SCHEMAS))]
    free = completion(target, {"prompt": ids, "temperature": 0.0, "max_tokens": 4, "ignore_eos": True}, a.timeout)
    bad = [why for i, r in enumerate(replies) if (why := invalid(r["text"], i))]
    print(f"[{label}] warm: {len(bad)} of {len(replies)} greedy constrained replies invalid; prompt tokens "
          f"{free['prompt_tokens']} (sent {len(ids)})", flush=True)
    for why in bad[:3]:
        print(f"[{label}]   {why}", flush=True)
    return {"warm_invalid": bad, "warm_tokens": [r["tokens"] for r in replies],
            "warm_finish": [r["finish_reason"] for r in replies], "prompt_tokens": free["prompt_tokens"]}


def start_ours(ckpt, a: argparse.Namespace, stack: contextlib.ExitStack) -> Target:
    work = WORK / "ours"
    shutil.rmtree(work, ignore_errors=True)
    overrides = [own_rendezvous(), f"torchrun.OMP_NUMBER_THREADS={a.omp_threads}", f"handler.dtype={a.dtype}",
                 "handler.prefix_caching=false", *a.yaml]
    folder = archive(REPO, ckpt, work / "model_store", a.tp, overrides)
    server = TorchServe(work, folder.parent, NAME)
    info: dict = {"overrides": overrides, "commit": git_describe(REPO), "dtype": a.dtype}
    stack.callback(lambda: info.update(stop=server.stop()))
    info["ready_s"] = start_ready(server)
    print(f"[ours] ready after {info['ready_s']:.0f} s", flush=True)
    return Target(server.inference_port, f"/predictions/{NAME}/1.0/v1/completions",
                  {"Authorization": f"Bearer {server.keys()['inference']}"}, {}, server.process, info)


def same_tokens(port: int, text: str, ids: list[int], ours_text: str) -> dict:
    """vLLM's tokenization of the prompt text against our ids, and its detokenization against our text."""
    theirs = post_json(port, "/tokenize", {"model": SERVED_NAME, "prompt": text})["tokens"]
    back = post_json(port, "/detokenize", {"model": SERVED_NAME, "tokens": ids[1:]})["prompt"]
    if theirs != ids or back != ours_text:
        at = next((i for i, (x, y) in enumerate(zip(theirs, ids)) if x != y), min(len(theirs), len(ids)))
        raise RuntimeError(f"vLLM's tokenizer differs from ours: {len(theirs)} ids against {len(ids)}, first "
                           f"difference at {at}; detokenized alike: {back == ours_text}")
    return {"prompt_ids_equal": True, "detokenized_equal": True}


def start_vllm(dtype: str, ckpt_mp1, ids: list[int], text: str, ours_text: str, a: argparse.Namespace,
               stack: contextlib.ExitStack) -> Target:
    label = f"vllm-{dtype}"
    hf_dir, port = vllm_folder(ckpt_mp1, WORK / label, a.vllm_max_model_len)
    tokenizer = tokenizer_in_venv(ckpt_mp1 / "tokenizer.model", OUT / "hf" / f"{ckpt_mp1.name}-tokenizer")
    structured = {"backend": a.vllm_backend}
    if not a.vllm_any_whitespace:
        structured["disable_any_whitespace"] = True
    extra = ["--structured-outputs-config", json.dumps(structured), *a.vllm_arg]
    server = VLLMServer(hf_dir, port, WORK / label, dtype, a.vllm_max_model_len, cores=a.vllm_cores,
                        kv_gib=a.vllm_kv_gib, extra_args=extra, tokenizer=tokenizer)
    info: dict = {"hf_dir": str(hf_dir), "tokenizer": str(tokenizer), "venv": str(VLLM_VENV), "dtype": dtype,
                  "structured_outputs_config": structured, "command": server.command}
    stack.callback(lambda: info.update(stop_returncode=server.stop()))
    server.start()
    info["ready_s"] = server.wait_ready(timeout=900)
    info["version"] = vllm_version()
    print(f"[{label}] ready after {info['ready_s']:.0f} s", flush=True)
    info.update(same_tokens(port, text, ids, ours_text))
    print(f"[{label}] its token ids of the prompt equal ours ({len(ids)})", flush=True)
    return Target(port, "/v1/completions", {}, {"model": SERVED_NAME}, server.process, info)


def start(name: str, ids: list[int], text: str, ours_text: str, a: argparse.Namespace,
          stack: contextlib.ExitStack) -> Target:
    """Server `name` up and warmed (stopped when `stack` closes)."""
    shape = dataclasses.replace(PRESETS[a.preset], n_layers=a.layers) if a.layers else PRESETS[a.preset]
    if name == "ours":
        target = start_ours(ensure_checkpoint(shape, mp=a.tp), a, stack)
    else:
        target = start_vllm(name.removeprefix("vllm-"), ensure_checkpoint(shape, mp=1), ids, text, ours_text, a,
                            stack)
    target.info.update(warm(name, target, ids, a))
    return target


# ---------------------------------------------------------------------------- turns

def median_level(runs: list[dict]) -> dict:
    """One level's rounds as one: each timing their median; errors, invalid replies and finish reasons
    summed over the rounds (any one counts); the rounds kept."""
    level = {key: value for key, value in runs[0].items() if key not in ("round", "settled_s")}
    for key, value in level.items():
        values = [r.get(key) for r in runs]
        if isinstance(value, (int, float)) and key not in ("clients", "errors", "invalid") and None not in values:
            level[key] = statistics.median(values)
    level["errors"] = sum(r["errors"] for r in runs)
    level["replies"] = sum(r["requests"] for r in runs)
    level["finish_reasons"] = dict(sum((Counter(r["finish_reasons"]) for r in runs), Counter()))
    if "invalid" in level:
        level["invalid"] = sum(r["invalid"] for r in runs)
    return dict(level, rounds=runs)


def taking_turns(targets: dict[str, Target], ids: list[int], a: argparse.Namespace) -> dict[str, list[dict]]:
    """Each level a.rounds times per server and kind of request, servers and kinds taking turns, the
    order reversed every round; the CPU the waiting servers used meanwhile is kept (idle_cpu_s)."""
    names = list(targets)
    processes = [t.process for t in targets.values()]
    out: dict[str, list[dict]] = {name: [] for name in names}
    for clients in a.concurrency:
        runs: dict[tuple[str, str], list[dict]] = {(n, m): [] for n in names for m in MODES}
        for r in range(a.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                waiting = [targets[n].process for n in names if n != name]
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    settled_s = settle(processes)
                    idle = sum(cpu_seconds(p) for p in waiting)
                    level = run_mode(targets[name], mode, clients, ids, a)
                    level.update(idle_cpu_s=sum(cpu_seconds(p) for p in waiting) - idle, round=r, settled_s=settled_s)
                    runs[name, mode].append(level)
                    print(f"[{name}] {clients} client(s), {mode}, round {r + 1}: {level['tokens_per_s']:.1f} tok/s, "
                          f"TPOT p50 {1e3 * (level.get('tpot_p50_s') or float('nan')):.0f} ms, errors "
                          f"{level['errors']}, invalid {level.get('invalid', '-')}, {level['finish_reasons']}",
                          flush=True)
        for name in names:
            out[name].append({"clients": clients, **{m: median_level(runs[name, m]) for m in MODES}})
    return out


# ---------------------------------------------------------------------------- command

def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=["ours", "vllm-float32"],
                        help="vllm-float32 / vllm-bfloat16: vLLM in that dtype (float32: no avx512_bf16 here)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--layers", type=int, help="the preset with this many layers (the vocabulary stays: a smoke "
                        "test's model)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="ours")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--omp-threads", type=int, default=2)
    parser.add_argument("--yaml", action="append", default=[], metavar="KEY=VALUE", help="model-config.yaml override")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=4, help="requests per client and kind, back to back")
    parser.add_argument("--sampling", choices=["seeded", "greedy"], default="seeded",
                        help="temperature 1 with a seed per request, or greedy")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=24, help="max_tokens of the unconstrained requests")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens of the constrained requests")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each level per server, all servers up and taking turns (1: one at a time)")
    parser.add_argument("--vllm-cores", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-max-model-len", type=int, default=1024)
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    parser.add_argument("--vllm-backend", choices=["xgrammar", "guidance"], default="xgrammar",
                        help="vLLM's structured-output backend (guidance: llguidance, as ours)")
    parser.add_argument("--vllm-any-whitespace", action="store_true",
                        help="vLLM's default JSON: whitespace allowed between tokens (ours never allows it)")
    parser.add_argument("--timeout", type=float, help="seconds one request may take (default 600)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 and 2 clients, 1 request each, a 32-token prompt")
    parser.add_argument("--out", default="structured", help="name of the JSON under bench/out/")
    parser.add_argument("--report", help="print the tables of an earlier run's JSON")


def run(a: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if a.report:
        print(report(json.loads(open(a.report).read())))
        return
    if a.rounds < 1:
        parser.error("--rounds: 1 or more")
    if a.quick:
        a.concurrency, a.requests, a.prompt_len = [1, 2], 1, 32
    a.timeout = a.timeout or 600.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through the with-blocks: servers stopped
    shape = dataclasses.replace(PRESETS[a.preset], n_layers=a.layers) if a.layers else PRESETS[a.preset]
    ckpt = ensure_checkpoint(shape, mp=a.tp)
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    text = prompt_text(ckpt, a.prompt_len)
    ids = tokenizer.encode(text, bos=True, eos=False)
    ours_text = tokenizer.decode(ids[1:])
    data: dict = {"preset": a.preset, "layers": shape.n_layers, "dtype": a.dtype, "tp": a.tp,
                  "omp_threads": a.omp_threads, "sampling": a.sampling, "prompt_len": len(ids), "prompt_ids": ids,
                  "new_tokens": a.new_tokens, "max_tokens": a.max_tokens, "requests": a.requests,
                  "concurrency": a.concurrency, "rounds": a.rounds, "vllm_cores": a.vllm_cores, "ckpt": str(ckpt),
                  "schemas": NAMES, "cpu_flags": cpu_flags(), "servers": {}, "failed": {}}
    groups = [[name] for name in a.servers] if a.rounds == 1 else [list(a.servers)]
    for group in groups:
        with contextlib.ExitStack() as stack:
            up = start_each(group, lambda name: start(name, ids, text, ours_text, a, stack), data["failed"])
            keep_levels(data, up, taking_turns(up, ids, a) if up else {})
    path = write_json(a.out, data)
    print(report(json.loads(path.read_text())))
    print(f"raw numbers: {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options(parser)
    run(parser.parse_args(argv), parser)


if __name__ == "__main__":
    main()
