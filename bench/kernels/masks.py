"""What a grammar constraint costs a decode step on Llama 3's 128,256-id vocabulary: finding the rows'
forced tokens, computing their token masks (llguidance) and picking under them.

    .venv/bin/python -m bench.kernels.masks [--walks 40] [--rows 1 8] [--max-steps 256] [--seed 0]
    .venv/bin/python -m bench.kernels.masks --quick          # smoke test: 3 walks per schema

Meta's real Llama 3 tokenizer.model (bench/lib/checkpoint.py), the llguidance tokenizer the server
builds over it (grammar_tokenizer), and each schema of the structured-output tests' corpus
(tests/support/schemas.py) compiled by the server's own GrammarCompiler (its limits, compact JSON).

A walk first takes its grammar's forced tokens, as the scheduler does (each the only token its mask
allows: no mask is computed for them), then picks the next token uniformly among those its mask
allows (the greedy pick of seeded random logits under the mask: random weights at temperature 1 pick
so), from the first token to the end-of-sequence token, and advances its matcher, as the engine
does. Each step is timed three times:
- forced: Constraint.forced and advance for every row (the scheduler's thread, before the forward);
- mask: Masks.start(...).result(), the engine's call, its worker thread included;
- pick: tp_llama.engine.sampling.sample_rows greedy under the masks, on [rows, 128256] float32
  logits (the C sampler reading the masks where the kernels built; else apply_masks' -inf copy).
The share of a walk's tokens that were forced is the share of masks never computed.
With --rows 1 one walk runs at a time; with 8, eight walks of one schema side by side, a finished walk
replaced at once by the next, so every timed step has eight constrained rows; "mixed" runs the eight
rows over the whole corpus (row i starts at schema i), as eight clients cycling through it do.
Every finished walk's text is validated against its schema (jsonschema), so a timing never comes from
a grammar that lets invalid replies through.

Prints, per schema and over all of them, the p50 / p99 / max of both times, the compile times (a fresh
compiler each repeat: never the cache) and the tokenizer's build time, with the CPU's flags and the
thread count; raw: bench/out/masks.json (--out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field

import jsonschema
import torch

from bench.lib.checkpoint import meta_llama3_tokenizer
from bench.lib.common import machine, table, write_json
from bench.lib.llamacpp import cpu_flags
from bench.serving.clients import percentile
from tests.support.schemas import NAMES, SCHEMAS
from tp_llama.engine.constraint import Constraint, Masks, grammar_tokenizer
from tp_llama.engine.sampling import SamplingParams, sample_rows
from tp_llama.engine.verify import Accepted
from tp_llama.serving.grammars import GrammarCompiler
from tp_llama.serving.request import GrammarSpec
from tp_llama.tokenizer import Tokenizer, load_tokenizer


def spec_of(schema: dict) -> GrammarSpec:
    return GrammarSpec("json", json.dumps(schema, sort_keys=True), "response_format")


@dataclass
class Walk:
    """One random walk through a schema's grammar: its matcher and the tokens picked so far."""

    schema: int
    constraint: Constraint
    tokens: list[int] = field(default_factory=list)


@dataclass
class Timings:
    """One configuration's steps: each mask and each application timed, seconds, and how walks ended."""

    forced_s: list[float] = field(default_factory=list)
    mask_s: list[float] = field(default_factory=list)
    pick_s: list[float] = field(default_factory=list)
    forced: int = 0  # tokens taken forced
    lengths: list[int] = field(default_factory=list)
    cut: int = 0
    invalid: list[str] = field(default_factory=list)


def compile_times(tokenizer, repeats: int) -> list[list[float]]:
    """Per schema, `repeats` compile times in seconds, each on a fresh compiler (its cache empty);
    the future's own result, so a slow schema shows its time rather than the server's 1 s refusal."""
    times = []
    for schema in SCHEMAS:
        runs = []
        for _ in range(repeats):
            compiler = GrammarCompiler(tokenizer, workers=1)
            started = time.perf_counter()
            compiler.submit(spec_of(schema)).future.result()
            runs.append(time.perf_counter() - started)
        times.append(runs)
    return times


def finish(walk: Walk, tokenizer: Tokenizer, out: Timings, cut: bool) -> None:
    out.lengths.append(len(walk.tokens))
    if cut:
        out.cut += 1
        return
    text = tokenizer.decode(walk.tokens)
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[walk.schema], format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError) as exc:
        out.invalid.append(f"{NAMES[walk.schema]}: {text[:120]!r}: {str(exc).splitlines()[0][:120]}")


def run_walks(schemas: list[int], rows: int, walks: int, compiler: GrammarCompiler, masks: Masks,
              tokenizer: Tokenizer, gen: torch.Generator, max_steps: int) -> Timings:
    """`rows` walks side by side until `walks` have ended, each new walk on the next schema of the cycle
    `schemas` (so row r starts at schemas[r]). Every step's mask and application timed."""
    cycle = itertools.count()
    n_words, stops = tokenizer.n_words, tokenizer.stop_ids

    def fresh() -> Walk:
        index = schemas[next(cycle) % len(schemas)]
        return Walk(index, compiler.compile_now(spec_of(SCHEMAS[index])))

    live = [fresh() for _ in range(rows)]
    out = Timings()
    at, greedy = list(range(rows)), [Accepted(SamplingParams(1), None, [], []) for _ in range(rows)]
    while len(out.lengths) < walks:
        started = time.perf_counter()
        for walk in live:
            forced = walk.constraint.forced(max_steps - len(walk.tokens))
            if forced:
                walk.constraint.advance(forced)
            walk.tokens += forced
            out.forced += len(forced)
        out.forced_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        bits = masks.start({r: (w.constraint, []) for r, w in enumerate(live)}, n_words).result().bits
        out.mask_s.append(time.perf_counter() - started)
        logits = torch.randn(rows, n_words, generator=gen)
        started = time.perf_counter()
        picked, _ = sample_rows(logits, greedy, bits, at)
        out.pick_s.append(time.perf_counter() - started)
        for r, token in enumerate(picked):
            walk = live[r]
            if token in stops or len(walk.tokens) >= max_steps:
                finish(walk, tokenizer, out, cut=token not in stops)
                live[r] = fresh()
                continue
            walk.tokens.append(token)
            if not walk.constraint.advance([token]):
                raise RuntimeError(f"{NAMES[walk.schema]}: the matcher refused a token its mask allowed: "
                                   f"{walk.constraint.error}")
    return out


def spread_ms(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    return " / ".join(f"{1e3 * v:.3f}" for v in (percentile(ordered, 50), percentile(ordered, 99), ordered[-1]))


def summary(t: Timings) -> dict:
    ordered = {key: sorted(getattr(t, key)) for key in ("forced_s", "mask_s", "pick_s")}
    stats = {f"{key[:-2]}_{name}_ms": 1e3 * (percentile(v, pct) if pct else v[-1])
             for key, v in ordered.items() for name, pct in (("p50", 50), ("p99", 99), ("max", None))}
    return {**stats, "steps": len(t.mask_s), "walks": len(t.lengths), "cut": t.cut, "invalid": len(t.invalid),
            "forced_tokens": t.forced, "forced_share": forced_share(t),
            "invalid_samples": t.invalid[:3], "tokens_mean": statistics.mean(t.lengths),
            "mask_ms": [round(1e3 * v, 4) for v in t.mask_s], "pick_ms": [round(1e3 * v, 4) for v in t.pick_s]}


def forced_share(t: Timings) -> float:
    """The share of the walks' tokens taken forced (no mask computed for them)."""
    return t.forced / max(1, sum(t.lengths))


def pooled(parts: list[Timings]) -> Timings:
    out = Timings()
    for part in parts:
        out.forced_s += part.forced_s
        out.forced += part.forced
        out.mask_s += part.mask_s
        out.pick_s += part.pick_s
        out.lengths += part.lengths
        out.cut += part.cut
        out.invalid += part.invalid
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--walks", type=int, default=40, help="finished walks per schema and row count")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="constrained rows per step")
    parser.add_argument("--max-steps", type=int, default=256, help="a walk still going after this is cut (counted)")
    parser.add_argument("--compile-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads for the pick (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 walks, 2 compiles per schema")
    parser.add_argument("--out", default="masks", help="name of the JSON under bench/out/")
    a = parser.parse_args(argv)
    if a.quick:
        a.walks, a.compile_repeats = 3, 2
    if a.threads:
        torch.set_num_threads(a.threads)
    tokenizer = load_tokenizer(meta_llama3_tokenizer())
    started = time.perf_counter()
    lltokenizer = grammar_tokenizer(tokenizer)
    tokenizer_s = time.perf_counter() - started
    compiles = compile_times(lltokenizer, a.compile_repeats)
    compiler, masks = GrammarCompiler(lltokenizer), Masks()
    gen = torch.Generator().manual_seed(a.seed)

    results: dict[str, dict[str, Timings]] = {}
    for rows in a.rows:
        runs = {}
        for i, name in enumerate(NAMES):
            runs[name] = run_walks([i], rows, a.walks, compiler, masks, tokenizer, gen, a.max_steps)
            print(f"[{rows} row(s)] {name}: {len(runs[name].mask_s)} steps, mask p50 "
                  f"{1e3 * statistics.median(runs[name].mask_s):.3f} ms", flush=True)
        if rows > 1:
            runs["mixed"] = run_walks(list(range(len(SCHEMAS))), rows, a.walks * len(SCHEMAS) // 2, compiler, masks,
                                      tokenizer, gen, a.max_steps)
        results[str(rows)] = runs

    flags = cpu_flags()
    cpu = machine()["cpu"]
    print(f"\n{cpu}, flags {' '.join(flags)}; {torch.get_num_threads()} torch threads; llguidance tokenizer "
          f"built in {tokenizer_s:.2f} s; vocabulary {tokenizer.n_words}")
    headers = ["schema", "compile ms p50 / max"]
    for rows in a.rows:
        headers += [f"{rows} row(s): walks (cut)", "tokens", "forced", "forced ms p50 / p99 / max",
                    "mask ms p50 / p99 / max", "pick ms p50 / p99 / max"]
    lines = []
    for i, name in enumerate([*NAMES, "mixed", "all"]):
        cells = [name]
        if i < len(NAMES):
            cells.append(" / ".join(f"{1e3 * v:.1f}" for v in (statistics.median(compiles[i]), max(compiles[i]))))
        else:
            every = [v for runs in compiles for v in runs] if name == "all" else None
            cells.append("" if every is None else f"{1e3 * statistics.median(every):.1f} / {1e3 * max(every):.1f}")
        for rows in a.rows:
            runs = results[str(rows)]
            t = pooled([runs[n] for n in NAMES]) if name == "all" else runs.get(name)
            if t is None:
                cells += [""] * 6
                continue
            cells += [f"{len(t.lengths)} ({t.cut})", f"{statistics.mean(t.lengths):.1f}", f"{forced_share(t):.0%}",
                      spread_ms(t.forced_s), spread_ms(t.mask_s), spread_ms(t.pick_s)]
        lines.append(cells)
    print(table(headers, lines))
    invalid = {rows: sum(len(t.invalid) for t in runs.values()) for rows, runs in results.items()}
    print(f"\ninvalid walks (text against its schema): {invalid}; CPU: {cpu}, flags {' '.join(flags)}")
    for rows, runs in results.items():
        for t in runs.values():
            for sample in t.invalid[:2]:
                print(f"  [{rows} row(s)] {sample}")
    data = {"tokenizer": str(meta_llama3_tokenizer()), "n_words": tokenizer.n_words, "tokenizer_build_s": tokenizer_s,
            "threads": torch.get_num_threads(), "cpu_flags": flags, "seed": a.seed, "walks": a.walks,
            "max_steps": a.max_steps, "compile_s": dict(zip(NAMES, compiles)),
            "runs": {rows: {name: summary(t) for name, t in runs.items()} | {"all": summary(pooled(
                [runs[n] for n in NAMES]))} for rows, runs in results.items()}}
    print(f"raw numbers: {write_json(a.out, data)}")


if __name__ == "__main__":
    main()
