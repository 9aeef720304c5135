"""Llama 4's layers in a decode step against their floor: Scout's shapes, one dense layer and one MoE layer.

    python -m bench.engine.moe_step [--quantize none int4] [--rows 1 8] [--repeats 20] [--prompt 512]

Scout's widths (dim 5120, 40 heads, 8 KV heads, 16 experts of width 8192 beside a shared one, a dense
FFN of 16384 as Maverick's dense layers have) cut to two layers (one MoE layer is 4.4 GB in bfloat16),
random weights built in memory and prepared for serving as a load prepares them (tp_llama.backend: the
C kernels' tiles, or their int4 tiles with --quantize int4), TP 1, every core. For each layer and row
count: the median seconds of the layer's forward over decode rows at position 256 with distinct
hidden states (the layers taking turns), the distinct experts those rows were routed to, and the floor:
the bytes the layer must read (attention, the dense FFN, or the router, the shared expert and each
expert routed to; the KV cache's rows) at the copy bandwidth measured in the same run. Then one prompt
step of --prompt rows through the MoE layer: how many times each expert's weights were run (once each:
an expert's rows go through its matmuls together).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch

from bench.lib.common import copy_bandwidth_gbs, machine, table
from bench.lib.llamacpp import cpu_flags
from tp_llama import backend
from tp_llama.model import ModelArgs, build
from tp_llama.model.args import MoEArgs
from tp_llama.model.batch import Batch

SCOUT = ModelArgs(dim=5120, n_layers=2, n_heads=40, n_kv_heads=8, vocab_size=4096, ffn_dim=16384, norm_eps=1e-5,
                  rope_theta=500000.0, family="llama4", moe=MoEArgs(16, 8192, interleave=2), nope_layer_interval=4,
                  use_qk_norm=True, attention_chunk_size=8192, attn_temperature_tuning=True)
POSITION, BLOCK = 256, 16


def weight_bytes(weight: object) -> int:
    """The bytes a matmul reads of a prepared weight (tiles, integer tiles with their scales, or a tensor)."""
    data = getattr(weight, "data", weight)
    return data.numel() * data.element_size()


def random_model(quantize: str) -> torch.nn.Module:
    """SCOUT in bfloat16 with random weights (init'd as a trained model's scale), prepared for serving."""
    torch.set_default_dtype(torch.bfloat16)  # built on the meta device, then filled once: 5 GB, not 15
    try:
        with torch.device("meta"):
            model = build(SCOUT)
    finally:
        torch.set_default_dtype(torch.float32)
    model = model.to_empty(device="cpu").requires_grad_(False)
    for name, param in model.named_parameters():
        fan_in = param.shape[-2] if "experts" in name or "router" in name else param.shape[-1]
        param.normal_(0, 1 / fan_in**0.5) if param.dim() > 1 else param.fill_(1)
    backend.preparation_for(torch.device("cpu"), torch.bfloat16, quantized=quantize).apply(model)
    blocks = 1 + (POSITION + 512) // BLOCK
    model.setup_caches(POSITION + 1024, 8 * blocks, BLOCK, torch.bfloat16, torch.device("cpu"), SCOUT.n_kv_heads)
    return model


def decode_batch(rows: int, spare: int) -> Batch:
    """`rows` decode rows at POSITION, each in its own blocks (`spare`: the cache's spare block)."""
    per_row = POSITION // BLOCK + 1
    spec = [(POSITION, [7], True, list(range(r * per_row, (r + 1) * per_row))) for r in range(rows)]
    return Batch.build(spec, BLOCK, spare, torch.device("cpu"))


def layer_bytes(layer: torch.nn.Module, experts_touched: int, rows: int) -> int:
    """What the layer reads: its attention's and FFN's weights (a MoE: the router, the shared expert and the
    experts routed to) and each row's keys and values up to POSITION."""
    attention, ffn = layer.attention, layer.feed_forward
    total = weight_bytes(attention.wqkv) + weight_bytes(attention.wo.weight)
    if hasattr(ffn, "routed"):
        one = weight_bytes(ffn.routed[0].w13) + weight_bytes(ffn.routed[0].w2.weight)
        total += weight_bytes(ffn.router) + weight_bytes(ffn.shared_expert.w13)
        total += weight_bytes(ffn.shared_expert.w2.weight) + experts_touched * one
    else:
        total += weight_bytes(ffn.w13) + weight_bytes(ffn.w2.weight)
    kv = attention.cache.k
    return total + 2 * rows * (POSITION + 1) * kv.shape[0] * kv.shape[2] * kv.element_size()


def time_layers(model: torch.nn.Module, rows: int, repeats: int) -> list[tuple[float, int]]:
    """(median seconds, distinct experts routed to) of each layer's forward over `rows` decode rows."""
    batch = decode_batch(rows, model.layers[0].attention.cache.spare)
    rotation = model.rope[batch.positions].unsqueeze(1)
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, SCOUT.dim, generator=gen).to(torch.bfloat16)
    seconds: list[list[float]] = [[] for _ in model.layers]
    touched = [0] * len(model.layers)
    for repeat in range(repeats + 2):  # two rounds of warm-up
        for i, layer in enumerate(model.layers):
            counts = getattr(layer.feed_forward, "tokens_per_expert", None)
            before = None if counts is None else counts.clone()
            started = time.perf_counter()
            layer(h, rotation, batch)
            if repeat >= 2:
                seconds[i].append(time.perf_counter() - started)
            if before is not None:
                touched[i] = int(((counts - before) > 0).sum())
    return [(statistics.median(s), t) for s, t in zip(seconds, touched)]


def prompt_runs(model: torch.nn.Module, tokens: int) -> Counter:
    """How many times each expert's matmuls ran in one prompt step of `tokens` rows through the MoE layer."""
    moe = model.layers[1].feed_forward
    runs: Counter = Counter()
    real = moe.expert

    def counted(x: torch.Tensor, e: int) -> torch.Tensor:
        runs[e] += 1
        return real(x, e)

    moe.expert = counted
    try:
        spec = [(0, list(range(tokens)), True, list(range(-(-tokens // BLOCK))))]
        batch = Batch.build(spec, BLOCK, model.layers[0].attention.cache.spare, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(tokens, SCOUT.dim, generator=gen).to(torch.bfloat16)
        model.layers[1](h, model.rope[batch.positions].unsqueeze(1), batch)
    finally:
        del moe.expert
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", nargs="+", default=["none", "int4"], choices=["none", "int8", "int4"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=512)
    a = parser.parse_args(argv)
    rows_out = []
    for quantize in a.quantize:
        started = time.perf_counter()
        model = random_model(quantize)
        print(f"{quantize}: built and prepared in {time.perf_counter() - started:.0f} s", flush=True)
        for rows in a.rows:
            gbs = copy_bandwidth_gbs()
            for (seconds, touched), (i, layer) in zip(time_layers(model, rows, a.repeats), enumerate(model.layers)):
                kind = "MoE" if hasattr(layer.feed_forward, "routed") else "dense"
                floor = layer_bytes(layer, touched, rows) / (gbs * 1e9)
                rows_out.append([quantize, kind, rows, seconds * 1e3, floor * 1e3, seconds / floor,
                                 touched if kind == "MoE" else "-", gbs])
                print(f"  {quantize} {kind} x{rows}: {seconds * 1e3:.1f} ms, floor {floor * 1e3:.1f} ms", flush=True)
        runs = prompt_runs(model, a.prompt)
        print(f"  {quantize}: a {a.prompt}-token prompt step ran {len(runs)} experts, each "
              f"{sorted(set(runs.values()))} time(s)", flush=True)
        del model
    print(table(["weights", "layer", "rows", "ms", "floor ms", "/ floor", "experts touched", "copy GB/s"], rows_out))
    print(f"\n{machine()['cpu']}; flags: {' '.join(cpu_flags())}; {torch.get_num_threads()} threads, TP 1")


if __name__ == "__main__":
    main()
