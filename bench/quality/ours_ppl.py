"""Our side of the quality table: a Meta checkpoint scored by tp_llama.cli.perplexity, unquantized and
quantized at load, on the very token ids llama-perplexity scores.

    python -m bench.quality.ours_ppl --ckpt bench/out/smollm2/rot0 [more] [--text wiki] \\
        [--quantize none int8 int4] [--chunks N] [--ctx 512] [--dtype float32]

For each checkpoint and each --quantize: the perplexity command on bench/out/quality/TEXT.ids (made by
bench.quality.texts with llama.cpp's tokenizer; --no-bos where llama.cpp adds none, as its .ids.json
says), its PPL +/- llama.cpp's error, the change against the unquantized run, and how often the top-1
token of each scored position agrees with the unquantized run's (--compare-to). Prints a table per
checkpoint with the CPU's flags and writes everything to bench/out/ours_ppl_TEXT.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.lib import llamacpp
from bench.lib.common import OUT, REPO, WEIGHT_BITS, table, write_json


def score(ckpt: Path, ids: Path, bos: bool, quantize: str, a: argparse.Namespace, base: Path | None) -> dict:
    """One perplexity run; its --json summary plus the wall time."""
    out = OUT / "quality" / f"ours-{ckpt.name}-{ids.stem}-{quantize}.json"
    command = [sys.executable, "-m", "tp_llama.cli.perplexity", "--ckpt-dir", str(ckpt), "--ids", str(ids),
               "--ctx", str(a.ctx), "--dtype", a.dtype, "--quantize", quantize, "--json", str(out)]
    command += ([] if bos else ["--no-bos"]) + (["--chunks", str(a.chunks)] if a.chunks else [])
    command += ["--compare-to", str(base)] if base is not None else []
    started = time.perf_counter()
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if run.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
    summary = json.loads(out.read_text())
    summary["seconds"] = time.perf_counter() - started
    summary["json"] = str(out)
    for bulky in ("token_logprobs", "top1"):  # kept in the run's own --json
        summary.pop(bulky, None)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, nargs="+", required=True, help="Meta checkpoints (bench.lib.smollm2)")
    parser.add_argument("--text", default="wiki", help="a name bench.quality.texts wrote ids for")
    parser.add_argument("--quantize", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--chunks", type=int, default=None, help="score only the first N chunks (default: all)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    a = parser.parse_args(argv)
    ids = OUT / "quality" / f"{a.text}.ids"
    bos = json.loads(ids.with_suffix(".ids.json").read_text()).get("add_bos", False)
    flags = llamacpp.cpu_flags()
    results = []
    for ckpt in a.ckpt:
        rows, base_ppl, base_json = [], None, None
        for quantize in a.quantize:
            summary = score(ckpt, ids, bos, quantize, a, base_json)
            if quantize == "none":
                base_ppl, base_json = summary["ppl"], Path(summary["json"])
            delta = None if base_ppl is None or quantize == "none" else 100 * (summary["ppl"] / base_ppl - 1)
            agree = 100 * summary["top1_agreement"] if "top1_agreement" in summary else None
            results.append({"model": ckpt.name, "quantize": quantize, **summary, "delta_pct": delta})
            rows.append([quantize, f"{summary['ppl']:.4f} ± {summary['ppl_error']:.4f}",
                         "" if delta is None else f"{delta:+.2f}%", WEIGHT_BITS[quantize],
                         "" if agree is None else f"{agree:.1f}%", summary.get("chunks", ""),
                         f"{summary['seconds']:.0f}"])
            print(f"  {ckpt.name} {quantize}: PPL {summary['ppl']:.4f}", file=sys.stderr, flush=True)
        print(f"\n{ckpt.name}, {a.text}, ctx {a.ctx}, {a.dtype}:\n")
        print(table(["quantize", "PPL", "vs none", "bits/weight", "top-1 = none", "chunks", "wall s"], rows))
    print(f"\nCPU flags: {' '.join(flags)}")
    path = write_json(f"ours_ppl_{a.text}", {"cpu_flags": flags, "text": a.text, "ctx": a.ctx, "chunks": a.chunks,
                                               "dtype": a.dtype, "results": results})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
