"""llama.cpp's side of the quality table: its own quantizations of an F32 GGUF, scored by llama-perplexity.

    python -m bench.quality.llamacpp_ppl --gguf bench/out/smollm2/rot0/model-f32.gguf [more GGUFs] \\
        [--text wiki] [--kinds F32 Q8_0 Q4_0 Q4_K_M] [--chunks N] [--ctx 512] [--threads 2]

For each F32 GGUF, llama-quantize makes Q8_0, Q4_0 and Q4_K_M beside it (model-q8_0.gguf, ...;
kept for later runs and for the speed comparison), then llama-perplexity scores every kind on the
text (`--text` a name from bench.quality.texts or a path): chunks of --ctx tokens, each on its second
half, --chunks limiting how many (the whole wiki text is about 1,000 chunks of 512). Prints a table
per model: PPL +/- llama.cpp's error, the change against F32, bits a weight, the time a chunk took,
and which tensor types each file really holds (llama-quantize falls back from a k-quant to Q5_0 or
Q8_0 for rows whose length is no multiple of 256, as in SmolLM2's 576-wide ones), and writes everything (logs' numbers, CPU flags, llama.cpp's version) to bench/out/NAME.json
(--out; default llamacpp_ppl_TEXT).

The KV cache is float32 and flash attention off (--kv-f16 for llama.cpp's defaults), so the rows
differ by their weights alone and the F32 row is what our float32 engine should reproduce.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.lib import llamacpp
from bench.lib.common import table, write_json
from bench.quality import texts

KINDS = ("F32", "Q8_0", "Q4_0", "Q4_K_M")


def quantized_path(f32: Path, kind: str) -> Path:
    return f32 if kind == "F32" else f32.with_name(f"model-{kind.lower()}.gguf")


def text_file(spec: str) -> Path:
    return texts.text_path(spec) if spec in texts.SOURCES else Path(spec)


def tensor_mix(gguf_path: Path) -> tuple[float, dict[str, int]]:
    """(bits a weight over all tensors, how many tensors of each type). llama-quantize falls back to
    other types where a row's length is no multiple of a type's block (k-quants need 256), so a
    kind's name alone does not say what the file holds."""
    import gguf

    tensors = gguf.GGUFReader(gguf_path).tensors
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    bits = 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)
    return bits, dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, nargs="+", required=True, help="F32 GGUFs (bench.lib.smollm2 --gguf)")
    parser.add_argument("--text", default="wiki", help=f"one of {sorted(texts.SOURCES)} or a text file")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), help="llama-quantize types; F32 is the file itself")
    parser.add_argument("--chunks", type=int, default=None, help="score only the first N chunks (default: all)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-f16", action="store_true", help="llama.cpp's default f16 KV cache and flash attention")
    parser.add_argument("--out", default=None, help="JSON name under bench/out (default llamacpp_ppl_TEXT)")
    args = parser.parse_args(argv)

    text = text_file(args.text)
    extra = [] if args.kv_f16 else ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]
    version = (llamacpp.SRC / ".version").read_text().strip() if (llamacpp.SRC / ".version").exists() else "?"
    flags = llamacpp.cpu_flags()
    print(f"llama.cpp b{version}, {args.threads} threads; CPU flags: {' '.join(flags)}", file=sys.stderr)
    results = []
    for f32 in args.gguf:
        rows, base, mixes = [], None, []
        for kind in args.kinds:
            path = quantized_path(f32, kind)
            seconds_q = 0.0 if kind == "F32" else llamacpp.quantize(f32, path, kind, threads=args.threads)
            run = llamacpp.perplexity(path, text, ctx=args.ctx, chunks=args.chunks, threads=args.threads, extra=extra)
            base = run.ppl if kind == "F32" else base
            bits, mix = tensor_mix(path)
            entry = {
                "model": str(f32.parent.name), "gguf": str(path), "kind": kind, "ppl": run.ppl, "ppl_err": run.ppl_err,
                "delta_pct": None if base is None else 100 * (run.ppl / base - 1),
                "bits_per_weight": bits, "tensor_types": mix, "mib": path.stat().st_size / 2**20,
                "chunks": run.chunks, "seconds": run.seconds, "seconds_per_chunk": run.seconds_per_chunk,
                "prompt_tokens_per_s": run.tokens_per_second, "quantize_seconds": seconds_q,
            }
            results.append(entry)
            rows.append([kind, f"{run.ppl:.4f} ± {run.ppl_err:.4f}" if run.ppl_err else f"{run.ppl:.4f}",
                         "" if entry["delta_pct"] is None else f"{entry['delta_pct']:+.2f}%",
                         f"{entry['bits_per_weight']:.2f}", f"{entry['mib']:.0f}", run.chunks,
                         f"{run.seconds_per_chunk:.2f}" if run.seconds_per_chunk else "", f"{run.seconds:.0f}"])
            mixes.append(f"{kind}: " + ", ".join(f"{n} {t}" for t, n in mix.items()))
            print(f"  {f32.parent.name} {kind}: PPL {run.ppl:.4f} over {run.chunks} chunks, {run.seconds:.0f} s",
                  file=sys.stderr)
        print(f"\n{f32.parent.name} ({f32}), {text.name}, ctx {args.ctx}:\n")
        print(table(["kind", "PPL", "vs F32", "bits/weight", "MiB", "chunks", "s/chunk", "wall s"], rows))
        print("\ntensors by type: " + "; ".join(mixes))
    print(f"\nCPU flags: {' '.join(flags)}")
    path = write_json(args.out or f"llamacpp_ppl_{Path(args.text).stem}", {
        "llamacpp": f"b{version}", "cpu_flags": flags, "text": str(text), "ctx": args.ctx, "chunks": args.chunks,
        "threads": args.threads, "kv_cache": "f16" if args.kv_f16 else "f32", "results": results,
    })
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
