"""Meta's int4 QLoRA format served: a Llama 3.2 1B-shaped checkpoint in it against our `quantize: int4`
of the same shape and llama.cpp's Q4_0, batch-1 prompt and decode tokens/s, taking turns.

    python -m bench.engine.meta_int4 [--rounds 3] [--prompt-len 64] [--new-tokens 32] [--before COMMIT_OR_PATH]

- "meta QLoRA int4": tp_llama.testing.meta_quant writes the llama3.2-1b preset's shape in Meta's int4
  format with torchao's quantizer (groups of 32, LoRA adaptors of rank 16, int8 embedding and output
  layer; once, under bench/out/ckpt/), served by our engine in bfloat16 (bench.engine.generate's worker).
- "ours int4": the preset's bfloat16 checkpoint with `quantize: int4` (the C kernels' int4 tiles).
- "llama.cpp Q4_0": `llama-bench` on the preset's Q4_0 GGUF (bench.serving.llamacpp_peer gguf makes it;
  bash bench/setup_llamacpp.sh builds llama.cpp), the same prompt length and new tokens.
- "meta QLoRA int4, before" (with --before): an older checkout serving the same checkpoint.
Every engine takes all the cores (ours as bench.lib.common.torchrun gives a rank them).
Random weights: the values do not change the time. The best of the rounds is kept for each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from bench.lib.checkpoint import PRESETS, ensure_checkpoint, meta_llama3_tokenizer
from bench.lib.common import OUT, REPO, before_root, last_json, table, torchrun
from tp_llama.testing.meta_quant import write_int4_checkpoint

PRESET = "llama3.2-1b"
LLAMA_BENCH = OUT / "llama.cpp" / "build" / "bin" / "llama-bench"


def meta_checkpoint() -> Path:
    """The preset's shape as Meta's QLoRA int4 checkpoint, written once."""
    shape = PRESETS[PRESET]
    folder = OUT / "ckpt" / f"meta-qlora-int4-d{shape.dim}-l{shape.n_layers}-v{shape.vocab_size}"
    if not (folder / "params.json").is_file():
        print(f"writing Meta's int4 QLoRA format of {PRESET} (once) to {folder}", flush=True)
        write_int4_checkpoint(folder, group=32, lora_rank=16, dim=shape.dim, n_layers=shape.n_layers,
                              n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, vocab_size=shape.vocab_size,
                              multiple_of=shape.multiple_of, ffn_dim_multiplier=shape.ffn_dim_multiplier,
                              tokenizer=meta_llama3_tokenizer())
    return folder


def ours(ckpt: Path, quantize: str, a: argparse.Namespace, root: Path = REPO) -> tuple[float, float]:
    args = ["--worker", "ours", "--ckpt", str(ckpt), "--batches", "1", "--prompt-len", str(a.prompt_len),
            "--new-tokens", str(a.new_tokens), "--dtype", "bfloat16", "--quantize", quantize]
    result = last_json(torchrun("bench.engine.generate", args, 1, timeout=900, repo=root))["results"][0]
    return result["prefill_tok_s"], result["decode_tok_s"]


def llamacpp(gguf: Path, a: argparse.Namespace) -> tuple[float, float]:
    run = subprocess.run([str(LLAMA_BENCH), "-m", str(gguf), "-t", str(os.cpu_count() or 1), "-p", str(a.prompt_len),
                          "-n", str(a.new_tokens), "-r", "1", "-o", "json"], capture_output=True, text=True,
                         check=True, timeout=900)
    tests = json.loads(run.stdout)
    prefill = next(t["avg_ts"] for t in tests if t["n_prompt"] > 0)
    decode = next(t["avg_ts"] for t in tests if t["n_gen"] > 0)
    return prefill, decode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--before", help="an older checkout to serve the Meta checkpoint too: a folder or a commit")
    a = parser.parse_args(argv)
    plain = ensure_checkpoint(PRESETS[PRESET], mp=1)
    gguf = OUT / "gguf" / plain.name / "model-q4_0.gguf"
    runs = {"meta QLoRA int4": lambda: ours(meta_checkpoint(), "none", a),
            "ours int4": lambda: ours(plain, "int4", a)}
    if a.before:
        runs["meta QLoRA int4, before"] = lambda: ours(meta_checkpoint(), "none", a, before_root(a.before))
    if LLAMA_BENCH.is_file() and gguf.is_file():
        runs["llama.cpp Q4_0"] = lambda: llamacpp(gguf, a)
    else:
        print(f"no llama.cpp row: {LLAMA_BENCH} or {gguf} missing", flush=True)
    best = {name: (0.0, 0.0) for name in runs}
    for _ in range(a.rounds):  # engines take turns, so a change in the machine's load hits all of them
        for name, run in runs.items():
            prefill, decode = run()
            print(f"{name}: prefill {prefill:.1f} tok/s, decode {decode:.2f} tok/s", flush=True)
            best[name] = (max(best[name][0], prefill), max(best[name][1], decode))
    base = best["ours int4"][1]
    print(f"\n{PRESET} shape, batch 1, {a.prompt_len}-token prompt, {a.new_tokens} new tokens, {os.cpu_count()} threads; "
          f"best of {a.rounds} rounds")
    print(table(["engine", "prefill tok/s", "decode tok/s", "decode time / ours int4"],
                [[name, f"{p:.1f}", f"{d:.2f}", f"{base / d:.2f}"] for name, (p, d) in best.items()]))


if __name__ == "__main__":
    main()
