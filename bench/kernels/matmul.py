"""The CPU matmul kinds of tp_llama.kernels on one model's weight shapes, side by side in one run.

    python -m bench.kernels.matmul [--preset quarter] [--rows 1 2 4 8 16 32 128 1024] [--repeats 10] [--bits 8 4]

For each dtype and row count: the time of one pass of x [rows, in] over every matmul weight of the
preset's layers (what a forward with that many tokens multiplies), for PyTorch's default
F.linear (MKL / oneDNN on plain weights), oneDNN's packed weights, our tiles
(tp_llama/kernels/cpu/matmul.c) and, on CPUs with AMX, the same tiles with bfloat16 calls of many
rows on AMX (kernels/cpu/amx.c); the kinds take turns within each repeat and the table keeps the
best of the repeats. GB/s = weight bytes / time: at few rows a pass can stream no faster than memory.
--bits 8 4 adds the same weights quantized at load into the integer tiles (kernels/cpu/quant.c),
"int8 tiles" and "int4 tiles", their GB/s counted in their own bytes (scales included).

--before COMMIT_OR_FOLDER adds that checkout's tiles ("tiles before"): its own C sources, built by
its own build.py for the same build variant and loaded into this process beside ours, multiply the
same packed weights (AMX's layout for bfloat16 on AMX CPUs, so its AMX kernel runs; "ours / before"
compares it with the kind that layout is ours for), taking turns with the other kinds. A kernel
change is so compared within seconds, where this VM's memory speed can change by half between runs
minutes apart. Refused when that checkout's tile layout or tiled_linear differ from ours.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import before_root, copy_bandwidth_gbs, table
from tp_llama.checkpoint.params import read_params
from tp_llama.kernels import choose, linear, onednn, prepare
from tp_llama.kernels.cpu.ffi import HEADER, Library, library, parse_header
from tp_llama.kernels.cpu.ops import tiled_linear


def weight_shapes(preset: str) -> list[tuple[int, int]]:
    """[out, in] of every matmul one forward runs: fused q/k/v, wo, fused w1/w3, w2 per layer, and the output."""
    args = read_params(ensure_checkpoint(PRESETS[preset], mp=1))
    d, hd, f = args.dim, args.head_dim, args.ffn_dim
    layer = [((args.n_heads + 2 * args.n_kv_heads) * hd, d), (d, args.n_heads * hd), (2 * f, d), (d, f)]
    return layer * args.n_layers + [(args.vocab_size, d)]


def before_tiles(root: Path) -> Library:
    """`root`'s C kernels, built by its own build.py for the build variant loaded here, loaded beside ours."""
    ours = library()
    code = "import sys; from tp_llama.kernels.cpu.build import build, compiler; print(build(sys.argv[1], compiler()))"
    done = subprocess.run([sys.executable, "-c", code, ours.variant], cwd=root, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(root)), check=False)
    if done.returncode:
        raise SystemExit(f"{root}: its kernels did not build: {done.stderr[-1500:]}")
    header = (root / "tp_llama" / "kernels" / "cpu" / "api.h").read_text()
    lib = Library(Path(done.stdout.split()[-1]), header, ours.variant)
    if (parse_header(header)[1]["tiled_linear"] != parse_header(HEADER.read_text())[1]["tiled_linear"]
            or lib.constants["TILE_COLS"] != ours.constants["TILE_COLS"]):
        raise SystemExit(f"{root}: its tiled_linear or tile width differ from ours; nothing to compare")
    lib.set_next_tile_min_chunks(ours.next_tile_min_chunks)
    return lib


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quarter")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--skip-plain", action="store_true",
                        help="leave out PyTorch's default F.linear (most of a run at few rows on the 1B shape)")
    parser.add_argument("--before", help="older checkout (a commit or a folder) whose tiles run beside ours")
    parser.add_argument("--bits", type=int, nargs="*", choices=[8, 4], default=[],
                        help="add the weights quantized to these bits, in the integer tiles")
    a = parser.parse_args(argv)
    best_kind, why = choose(torch.device("cpu"), torch.float32)
    if best_kind not in ("amx", "tiles"):
        raise SystemExit(f"no tiled kernel here: {why}")
    kinds = ("plain", "onednn", "tiles", "amx") if best_kind == "amx" else ("plain", "onednn", "tiles")
    kinds = tuple(kind for kind in kinds if kind != "plain" or not a.skip_plain) + (("before",) if a.before else ())
    kinds += tuple(f"int{bits}" for bits in a.bits)
    before = before_tiles(before_root(a.before)) if a.before else None
    shapes = weight_shapes(a.preset)
    print(f"copy bandwidth {copy_bandwidth_gbs():.1f} GB/s; {torch.get_num_threads()} threads; "
          f"{len(shapes)} weights of {a.preset}", flush=True)
    rows_out = []
    for dtype in (getattr(torch, name) for name in a.dtypes):
        gen = torch.Generator().manual_seed(0)
        plain = [torch.randn(shape, generator=gen).mul_(0.02).to(dtype) for shape in shapes]
        here = [kind for kind in kinds if kind != "onednn" or onednn.available(dtype)]  # AVX2: no bf16 oneDNN
        weights = {kind: [prepare(w, kind) for w in plain] for kind in here if kind not in ("before", "int8", "int4")}
        weights |= {f"int{bits}": [prepare(w, "tiles", bits=bits) for w in plain] for bits in a.bits}
        mine = "amx" if best_kind == "amx" and dtype == torch.bfloat16 else "tiles"  # the tiles "before" runs too
        weights["before"] = weights[mine]
        nbytes = {kind: sum(w.numel() * w.element_size() for w in plain) for kind in kinds}
        nbytes |= {f"int{bits}": sum(w.data.numel() for w in weights[f"int{bits}"]) for bits in a.bits}
        for rows in a.rows:
            xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {s[1] for s in shapes}}
            best = dict.fromkeys(kinds, float("inf"))
            repeats = a.repeats if rows <= 32 else max(2, a.repeats // 4)
            for _ in range(repeats):
                for kind in here:  # taking turns, so a change in the machine's load hits all of them
                    started = time.perf_counter()
                    for w in weights[kind]:
                        if kind == "before":
                            tiled_linear(xs[w.shape[1]], w, before)
                        else:
                            linear(xs[w.shape[1]], w)
                    best[kind] = min(best[kind], time.perf_counter() - started)
            ours = min(best["tiles"], best.get("amx", float("inf")))
            rows_out.append([
                str(dtype).removeprefix("torch."), rows, *(1e3 * best[k] for k in kinds),
                *(nbytes[k] / best[k] / 1e9 for k in kinds), ours / best.get("onednn", float("nan")),
                ours / best.get("plain", float("nan")),
                *([best[mine] / best["before"]] if before else []),
            ])
            print(f"{dtype} rows {rows}: " + ", ".join(f"{k} {1e3 * best[k]:.2f} ms" for k in here), flush=True)
        del weights, plain  # before the next dtype's: the 1B shape's float32 copies fill most of 24 GiB
    names = {"plain": "F.linear", "onednn": "oneDNN", "tiles": "tiles", "amx": "AMX tiles", "before": "tiles before",
             "int8": "int8 tiles", "int4": "int4 tiles"}
    print(table(["dtype", "rows", *(f"{names[k]} ms" for k in kinds), *(f"{names[k]} GB/s" for k in kinds),
                 "ours / oneDNN", "ours / F.linear", *(["ours / before"] if before else [])], rows_out))


if __name__ == "__main__":
    main()
