"""Generation speed of two checkouts side by side: TP 1 and TP 2 prefill/decode tokens/s, before vs after.

    python -m bench.engine.compare_tp --before /path/to/other/checkout [--after .] [--ckpt DIR]
                                      [--batches 1 8] [--prompt-len 128] [--new-tokens 64] [--rounds 2]

Each launch is `bench.engine.generate --worker ours` run from one checkout's code (PYTHONPATH and
working directory), so both are timed by the same worker; the four engines (before/after x
TP 1/TP 2) take turns in every round, and medians over the rounds are shown.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import REPO, last_json, module_in, table, torchrun, write_json
from bench.lib.generation import agreement, pooled


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="root of the checkout to compare against")
    parser.add_argument("--after", type=Path, default=REPO)
    parser.add_argument("--ckpt", type=Path, help="MP 1 checkpoint (default: the quarter preset, written once)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    a = parser.parse_args(argv)
    ckpt = a.ckpt or ensure_checkpoint(PRESETS["quarter"], mp=1)
    common = ["--worker", "ours", "--ckpt", str(ckpt.resolve()), "--batches", *map(str, a.batches),
              "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens), "--repeats", "1"]
    engines = [(tree, tp) for tree in ("before", "after") for tp in (1, 2)]
    roots = {"before": a.before.resolve(), "after": a.after.resolve()}
    launches: dict[tuple[str, int], list[dict]] = {e: [] for e in engines}
    for r in range(a.rounds):
        for tree, tp in engines[r % 4:] + engines[: r % 4]:  # a different engine first each round
            worker = module_in(roots[tree], "bench.engine.generate", "bench.bench_generate")
            out = last_json(torchrun(worker, common, tp, timeout=900, repo=roots[tree]))
            launches[(tree, tp)].append(out)
            print(f"round {r + 1} {tree} TP{tp}: " + ", ".join(
                f"batch {x['batch']} prefill {x['prefill_tok_s']:.0f} decode {x['decode_tok_s']:.1f} tok/s"
                for x in out["results"]), flush=True)
    res = {e: pooled(outs)["results"] for e, outs in launches.items()}

    # Medians, and the best launch: on a shared machine other users' load only ever slows a launch down.
    rows = []
    for stat in ("median", "best"):
        for i, batch in enumerate(a.batches):
            for phase in ("prefill", "decode"):
                key = f"{phase}_tok_s"
                pick = (lambda e: res[e][i][key]) if stat == "median" else (
                    lambda e: max(s[key] for s in res[e][i]["samples"]))
                v = {e: pick(e) for e in engines}
                rows.append([stat, batch, phase, v[("before", 1)], v[("before", 2)], v[("after", 1)],
                             v[("after", 2)], v[("before", 2)] / v[("before", 1)], v[("after", 2)] / v[("after", 1)],
                             v[("after", 2)] / v[("before", 2)]])
    headers = ["of launches", "batch", "phase", "before TP1 tok/s", "before TP2 tok/s", "after TP1 tok/s",
               "after TP2 tok/s", "before TP2/TP1", "after TP2/TP1", "TP2 after/before"]
    agree = {f"{tree} TP{tp}": [agreement(res[("before", 1)][i]["tokens"], res[(tree, tp)][i]["tokens"])
                                for i in range(len(a.batches))] for tree, tp in engines}
    print(table(headers, rows))
    print(f"\n- {ckpt.name}, float32, prompt {a.prompt_len} tokens, {a.new_tokens} new tokens, greedy; {a.rounds} "
          f"launches per engine, taking turns (median and best launch). TP 2 runs two ranks with one thread each.")
    print(f"- Greedy tokens identical to before TP1 for the first N tokens (per batch size): {agree}")
    for rows_ in res.values():
        for x in rows_:
            del x["tokens"]
    path = write_json("compare_tp", {"before": str(roots["before"]), "after": str(roots["after"]), "ckpt": str(ckpt),
                                     "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "rounds": a.rounds,
                                     "table": {"headers": headers, "rows": rows}, "agreement_with_before_tp1": agree,
                                     "engines": {f"{t} TP{p}": res[(t, p)] for t, p in engines}})
    print(f"raw numbers: {path}")


if __name__ == "__main__":
    main()
