"""Memory of a loaded worker, 16-bit and quantized: what stays resident and what a load peaks at.

    python -m bench.engine.memory [--preset llama3.2-1b] [--quantize none int8 int4] [--kv-gb 0.25]
    python -m bench.engine.memory --llama4 [--quantize none int4]

Each load runs in a fresh process (TP 1, the yaml's dtype, a KV pool of --kv-gb), which then reads
its resident set (VmRSS) and its peak (VmHWM) from /proc/self/status. A twin checkpoint of the same
shape with 1 layer (an engine needs one) is loaded the same way for each --quantize:
resident(model) - resident(1 layer) is what the other layers cost, compared with what they should
(their matmul weights in the quantized layout; the KV pool is the same size in both), and the peak
with the resident set plus the largest 16-bit tensor of the checkpoint (issue 46's bounds: 1.1x,
and resident + largest).

--llama4: a Llama 4 checkpoint in Meta's download layout (tests/support/meta_llama4.py's writer; dim 1024,
4 layers, MoE every second one with 16 experts) against a process that loads nothing (torch and the
engine imported): what the model holds against its weights at their bits (the router, norms and
embedding 16-bit), and the peak against the resident set plus the largest 16-bit tensor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import OUT, REPO, WEIGHT_BITS, table, write_json
from tp_llama.checkpoint.params import read_params
from tp_llama.parallel.layout import full_shapes

WORKER = """
import json, sys
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
ckpt, quantize, kv_gb = sys.argv[1], sys.argv[2], float(sys.argv[3])
engine = Engine.load(EngineConfig(ckpt, max_seq_len=512, max_batch_size=1, quantize=quantize, kv_cache_memory_gb=kv_gb))
status = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("Vm")}
print(json.dumps({"rss_mb": status["VmRSS"], "peak_mb": status["VmHWM"], "load_s": engine.load_s}))
"""


def measure(ckpt: str, quantize: str, kv_gb: float) -> dict:
    run = subprocess.run([sys.executable, "-c", WORKER, ckpt, quantize, str(kv_gb)], cwd=REPO, capture_output=True,
                         text=True, check=False, timeout=1800)
    if run.returncode:
        raise SystemExit(f"{ckpt} {quantize}: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


EMPTY = """
import json, torch
from tp_llama.engine.core import Engine
status = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("Vm")}
print(json.dumps({"rss_mb": status["VmRSS"], "peak_mb": status["VmHWM"]}))
"""
LLAMA4 = {"dim": 1024, "n_layers": 4, "n_heads": 16, "n_kv_heads": 8, "vocab_size": 8192, "multiple_of": 256,
          "ffn_dim_multiplier": 1.0, "ffn_exp": 4.0, "moe_args": {"num_experts": 16, "interleave_moe_layer_step": 2}}


def llama4(quantizes: list[str], kv_gb: float) -> None:
    """The --llama4 table (see the module's docstring)."""
    from tests.support.meta_llama4 import small_params, write_llama4_checkpoint
    from tp_llama.testing.tokenizer_train import build_tokenizer

    folder = OUT / "llama4-memory"
    if not (folder / "params.json").is_file():
        write_llama4_checkpoint(folder, small_params(**LLAMA4), 1, seed=0)
        build_tokenizer("llama3", folder / "tokenizer.model", 512)  # 256 ranks, read with Llama 4's specials
    shapes = full_shapes(read_params(folder))
    run = subprocess.run([sys.executable, "-c", EMPTY], cwd=REPO, capture_output=True, text=True, check=True)
    empty = json.loads(run.stdout.strip().splitlines()[-1])
    largest_mb = max(math.prod(v) for v in shapes.values()) * 2 / 2**20
    matmul = sum(math.prod(v) for k, v in shapes.items() if len(v) > 1 and "router" not in k and "tok_emb" not in k)
    rest = sum(math.prod(v) for v in shapes.values()) - matmul
    rows = []
    for quantize in quantizes:
        model = measure(str(folder), quantize, kv_gb)
        expected_mb = (matmul * WEIGHT_BITS[quantize] / 8 + rest * 2) / 2**20 + kv_gb * 1024
        held_mb = model["rss_mb"] - empty["rss_mb"]
        rows.append([quantize, f"{held_mb:.0f}", f"{expected_mb:.0f}", f"{held_mb / expected_mb:.2f}x",
                     f"{model['peak_mb']:.0f}", f"{model['rss_mb'] + largest_mb:.0f}", f"{model['load_s']:.1f}"])
    print(table(["quantize", "held MB (less an empty engine)", "weights at their bits + KV MB", "ratio", "peak MB",
                 "resident + largest 16-bit MB", "load s"], rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--quantize", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--kv-gb", type=float, default=0.25)
    parser.add_argument("--llama4", action="store_true", help="a Llama 4 checkpoint in Meta's layout instead")
    a = parser.parse_args(argv)
    if a.llama4:
        return llama4(a.quantize, a.kv_gb)
    shape = PRESETS[a.preset]
    full = ensure_checkpoint(shape, 1)
    empty = ensure_checkpoint(dataclasses.replace(shape, n_layers=1), 1)
    shapes = full_shapes(read_params(full))
    first = sum(math.prod(v) for k, v in shapes.items() if k.startswith("layers.0.") and len(v) == 2)
    layer_weights = first * (shape.n_layers - 1)  # every layer's matmuls but the twin's one
    largest_mb = max(math.prod(v) for v in shapes.values()) * 2 / 2**20
    rows, results = [], []
    for quantize in a.quantize:
        model, twin = measure(str(full), quantize, a.kv_gb), measure(str(empty), quantize, a.kv_gb)
        layers_mb = model["rss_mb"] - twin["rss_mb"]
        expected_mb = layer_weights * WEIGHT_BITS[quantize] / 8 / 2**20
        results.append({"quantize": quantize, "model": model, "one_layer": twin, "layers_mb": layers_mb,
                        "expected_layers_mb": expected_mb, "largest_16bit_tensor_mb": largest_mb})
        rows.append([quantize, f"{model['rss_mb']:.0f}", f"{twin['rss_mb']:.0f}", f"{layers_mb:.0f}",
                     f"{expected_mb:.0f}", f"{layers_mb / expected_mb:.2f}x", f"{model['peak_mb']:.0f}",
                     f"{model['rss_mb'] + largest_mb:.0f}", f"{model['load_s']:.1f}"])
        print(f"  {quantize}: {json.dumps(results[-1])}", file=sys.stderr, flush=True)
    print(table(["quantize", "resident MB", "1 layer MB", "other layers MB", "their weights MB", "ratio", "peak MB",
                 "resident + largest 16-bit MB", "load s"], rows))
    write_json(f"memory_{a.preset}", {"preset": a.preset, "kv_gb": a.kv_gb, "results": results})


if __name__ == "__main__":
    main()
