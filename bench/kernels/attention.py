"""A prompt chunk's attention: the C kernel against PyTorch's flash kernel.

    python -m bench.kernels.attention [--preset llama3.2-1b] [--chunks 0:200 0:512 312:200] [--builds ...]
                                      [--dtype bfloat16|float32]

The C kernel: kernels/cpu/prompt_attention.c in bfloat16; in float32, every row of the chunk as a
decode row (decode_attention's write_first, its keys written first; that write is timed too), the
path float32 prompts take. One layer of the preset's heads, each chunk given as START:ROWS (rows at positions
START .., against the keys before them too, read through a block table as a long prompt's later
chunk or a cached prefix would be). For each build of the C kernels this CPU runs (or those named),
a fresh process times both kernels taking turns and keeps the best of --repeats; GFLOPS count the
visible (causal) scores only.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import parse_table, table, torchrun
from tp_llama.checkpoint.params import read_params
from tp_llama.kernels.cpu import ops
from tp_llama.kernels.cpu.build import runnable
from tp_llama.kernels.cpu.ffi import library

HEADERS = ["build", "start", "rows", "C ms", "PyTorch flash ms", "C / flash", "C GFLOPS", "flash GFLOPS"]
BLOCK = 16


def time_chunk(heads: int, kv_heads: int, head_dim: int, start: int, rows: int, repeats: int,
               dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """Best seconds of the C kernel and of PyTorch's flash kernel on one chunk."""
    gen = torch.Generator().manual_seed(0)
    blocks = (start + rows + BLOCK - 1) // BLOCK
    cache_k, cache_v = (torch.randn(kv_heads, blocks * BLOCK, head_dim, generator=gen).to(dtype) for _ in range(2))
    table_ = torch.randperm(blocks, generator=gen)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    out = torch.empty(rows, heads * head_dim, dtype=dtype)
    # float32's rows: no rotation (cos 1, sin 0), every row's table, its position (kept alive for the struct)
    held = (torch.stack((torch.ones(rows, head_dim // 2), torch.zeros(rows, head_dim // 2)), dim=-1),
            table_.expand(rows, blocks).contiguous(), torch.arange(start, start + rows))
    as_rows = ops.decode_rows(*held)
    positions = torch.arange(start + rows)
    at = table_[positions // BLOCK] * BLOCK + positions % BLOCK
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim).transpose(0, 1).unsqueeze(0)
    keys, values = cache_k[:, at].unsqueeze(0), cache_v[:, at].unsqueeze(0)  # gathered beforehand: not timed
    seen = positions <= (start + torch.arange(rows)).unsqueeze(1)

    def c_kernel() -> None:
        if dtype == torch.float32:
            ops.decode_attention(qkv, as_rows, cache_k, cache_v, BLOCK, out, write_first=True)
        elif not ops.prompt_attention(qkv, heads, head_dim, cache_k, cache_v, BLOCK, table_, start, out):
            raise SystemExit(f"the {library().variant} build does not take this chunk")

    def flash() -> None:
        if start:
            F.scaled_dot_product_attention(q, keys, values, attn_mask=seen, enable_gqa=True)
        else:
            F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)

    best = [float("inf"), float("inf")]
    c_kernel(), flash()
    for _ in range(repeats):
        for i, run in enumerate((c_kernel, flash)):
            started = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - started)
    return best[0], best[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--chunks", nargs="+", default=["0:200", "0:512", "312:200", "0:2048"], metavar="START:ROWS")
    parser.add_argument("--builds", nargs="+", help="builds of the C kernels to compare (default: all this CPU runs; "
                                                    "TP_LLAMA_KERNELS set: that one, in this process)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    a = parser.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    args = read_params(ensure_checkpoint(PRESETS[a.preset], mp=1))
    chunks = [tuple(int(v) for v in chunk.split(":")) for chunk in a.chunks]
    if os.environ.get("TP_LLAMA_KERNELS"):  # one build, in this process
        rows = []
        for start, length in chunks:
            c, flash = time_chunk(args.n_heads, args.n_kv_heads, args.head_dim, start, length, a.repeats, dtype)
            flops = 4 * args.n_heads * args.head_dim * length * (start + (length + 1) / 2)
            rows.append([library().variant, start, length, 1e3 * c, 1e3 * flash, c / flash, flops / c / 1e9,
                         flops / flash / 1e9])
        print(table(HEADERS, rows))
        return
    rows = []
    for build in a.builds or runnable():
        stdout = torchrun("bench.kernels.attention", ["--preset", a.preset, "--repeats", str(a.repeats), "--dtype",
                                                      a.dtype, "--chunks", *a.chunks], 1, timeout=1800,
                          env={"TP_LLAMA_KERNELS": build})
        rows += [list(row.values()) for row in parse_table(stdout)]
        print(f"{build}: done", flush=True)
    print(table(HEADERS, rows))
    print(f"\n{a.preset}: {args.n_heads} query heads, {args.n_kv_heads} KV heads, head_dim {args.head_dim}, one layer, "
          f"{a.dtype}, {torch.get_num_threads()} threads; best of {a.repeats}.")


if __name__ == "__main__":
    main()
