"""Decode attention at long contexts: the C kernel's time against the bytes it reads and the FLOPs it does.

    python -m bench.kernels.decode_attention [--shape smollm2-135m] [--contexts 100 1000 1700] [--rows 8]
                                             [--verify 8 25] [--steps 20]

The C kernel (kernels/cpu/layer.c's decode_attention) in bfloat16 over every layer of the shape, each layer's
cache its own, as a decode step reads them (together far larger than the last-level cache), blocks of 16:
- "decode": --rows rows, a sequence each, at each context, their block tables laid out three ways: each row's
  blocks in one run ("runs"); handed out to the rows in turn, as rows that decode together grow ("in turn");
  and in random order, what a long-running server's pool ends up giving ("random");
- "verify": --verify positions of one sequence, as a speculative step sends them (each key written before any
  position attends), at each context, its table in random order.
Milliseconds a step (median of --steps, after one untimed), GB/s of the keys and values read (each once; a
verify step's positions share theirs) and GFLOPS (qK and pV, two FLOPs a product). This process's read
bandwidth is printed beside: the floor of a step that reads its bytes once.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.lib.common import read_bandwidth_gbs, table
from bench.lib.llamacpp import cpu_flags
from tp_llama.kernels.cpu import ops
from tp_llama.kernels.cpu.ffi import library

SHAPES = {  # query heads, KV heads, head_dim, layers
    "smollm2-135m": (9, 3, 64, 30),
    "llama3.2-1b": (32, 8, 64, 16),
    "llama3.1-8b": (32, 8, 128, 32),
}
BLOCK = 16
HEADERS = ["kind", "rows", "context", "tables", "ms", "KV GB/s", "GFLOPS"]


def tables_for(rows: int, width: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """Block tables [rows, width] over a pool of rows * width blocks."""
    blocks = torch.arange(rows * width)
    if layout == "runs":
        return blocks.view(rows, width).contiguous()
    if layout == "in turn":
        return blocks.view(width, rows).t().contiguous()
    return torch.randperm(rows * width, generator=gen).view(rows, width)


def time_step(shape: tuple[int, int, int, int], positions: torch.Tensor, tables: torch.Tensor, steps: int,
              write_first: bool) -> float:
    """Median seconds of one step's attention over every layer."""
    heads, kv_heads, head_dim, layers = shape
    gen = torch.Generator().manual_seed(0)
    rows, pool = len(positions), int(tables.max()) + 1
    caches = [tuple(torch.randn(kv_heads, pool * BLOCK, head_dim, generator=gen).bfloat16() for _ in range(2))
              for _ in range(layers)]
    held = (torch.stack((torch.ones(rows, head_dim // 2), torch.zeros(rows, head_dim // 2)), -1).contiguous(),
            tables, positions)  # kept alive for the struct
    decode_rows = ops.decode_rows(*held)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16()
    out = torch.empty(rows, heads * head_dim, dtype=torch.bfloat16)

    def step() -> None:
        for k, v in caches:
            ops.decode_attention(qkv, decode_rows, k, v, BLOCK, out, write_first=write_first)

    step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(shape: tuple[int, int, int, int], kind: str, rows: int, context: int, layout: str,
            steps: int) -> list[object]:
    heads, kv_heads, head_dim, layers = shape
    gen = torch.Generator().manual_seed(1)
    if kind == "decode":
        positions = torch.full((rows,), context)
        tables = tables_for(rows, context // BLOCK + 1, layout, gen)
        keys_read = rows * (context + 1)
    else:
        positions = torch.arange(context, context + rows)
        tables = tables_for(1, (context + rows - 1) // BLOCK + 1, layout, gen).expand(rows, -1).contiguous()
        keys_read = context + rows
    seconds = time_step(shape, positions, tables, steps, write_first=kind == "verify")
    kv_bytes = 2 * keys_read * kv_heads * head_dim * 2 * layers
    flops = 4 * heads * head_dim * int((positions + 1).sum()) * layers
    return [kind, rows, context, layout, 1e3 * seconds, kv_bytes / seconds / 1e9, flops / seconds / 1e9]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 1000, 1700])
    parser.add_argument("--rows", type=int, default=8, help="decode rows, a sequence each")
    parser.add_argument("--verify", type=int, nargs="*", default=[8, 25], help="positions of a verify step")
    parser.add_argument("--steps", type=int, default=20)
    a = parser.parse_args(argv)
    shape = SHAPES[a.shape]
    cases = [("decode", a.rows, c, layout) for c in a.contexts for layout in ("runs", "in turn", "random")]
    cases += [("verify", n, c, "random") for n in a.verify for c in a.contexts]
    rows = []
    for case in cases:
        rows.append(measure(shape, *case, a.steps))
        print(f"{case}: done", flush=True)
    print(table(HEADERS, rows))
    heads, kv_heads, head_dim, layers = shape
    print(f"\n{a.shape}: {heads} query heads, {kv_heads} KV heads, head_dim {head_dim}, {layers} layers, bfloat16, "
          f"blocks of {BLOCK}; build {library().variant}, {torch.get_num_threads()} threads; CPU flags: "
          f"{' '.join(cpu_flags())}; read bandwidth {read_bandwidth_gbs():.1f} GB/s; medians of {a.steps} steps.")


if __name__ == "__main__":
    main()
