"""Memory of a loaded worker, 16-bit and quantized: what stays resident and what a load peaks at.

    python -m bench.engine.memory [--preset llama3.2-1b] [--quantize none int8 int4] [--kv-gb 0.25]

Each load runs in a fresh process (TP 1, the yaml's dtype, a KV pool of --kv-gb), which then reads
its resident set (VmRSS) and its peak (VmHWM) from /proc/self/status. A twin checkpoint of the same
shape with 1 layer (an engine needs one) is loaded the same way for each --quantize:
resident(model) - resident(1 layer) is what the other layers cost, compared with what they should
(their matmul weights in the quantized layout; the KV pool is the same size in both), and the peak
with the resident set plus the largest 16-bit tensor of the checkpoint (issue 46's bounds: 1.1x,
and resident + largest).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import REPO, WEIGHT_BITS, table, write_json
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--quantize", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--kv-gb", type=float, default=0.25)
    a = parser.parse_args(argv)
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
