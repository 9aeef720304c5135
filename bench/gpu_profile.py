"""Where a GPU decode step's time goes, and prompt throughput against the card's peak.

    python -m bench.gpu_profile [--rows 1 32] [--context 512] [--prompt 2048] [--fp8] [--kv-block 16]
    PYTHONPATH=<older checkout> python bench/gpu_profile.py   # the same measurement of older code

On a Llama 3 8B-shaped model in bfloat16 (random weights made on the GPU, as bench.gpu_check
does), for each row count: the captured decode step timed as the engine runs it (host work, the
graph's replay and a sync every step), then torch.profiler over its replays, every kernel put in
one category by its name (the table lists what each category caught, so a wrong guess shows),
and the step's matmuls timed alone at the same shapes (their bandwidth, and what the weight
stream alone costs). Then greedy sampling of the step's logits, and one eager prompt step of
`--prompt` tokens against a dense bfloat16 matmul's rate measured in the same run. --fp8: the FFN of every
layer but the first and the last in Meta's 405B FP8 form (float8 e4m3, a scale a row, torch._scaled_mm),
its floor counting those weights at a byte each.

Needs only PyTorch (2.11 or newer) and a GPU, like bench.gpu_check. `--device cpu --small` runs
every path on a small model and the CPU, uncompiled, with empty kernel tables (the tests' run).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from checks.gpu_check import LLAMA3_8B, SMALL, copy_bandwidth, random_state, served_engine
from tp_llama import backend
from tp_llama.kernels import Fp8Weight, linear
from tp_llama.engine.decode_step import DecodeStep
from tp_llama.engine.plan import Row
from tp_llama.model.batch import Batch
from tp_llama.parallel.distributed import DistInfo

# First match wins: a kernel's name carries the ops inductor fused into it, or the library's name.
CATEGORIES = (
    ("matmul", r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitk|sm90_|sm80_|_tn_|_nt_"),
    ("attention", r"flex|triton_tem|attention|flash|fmha|sdpa"),
    ("KV-cache write", r"index_put|scatter"),
    ("norm (+ residual add)", r"rsqrt|rms_norm|mean"),
    ("SwiGLU", r"silu|sigmoid"),
    ("RoPE", r"stack|cos|sin|view_as"),
    ("embedding", r"embedding"),
    ("block mask / step inputs", r"zeros|full|gather|floor|remainder|clamp|arange|lt_|le_|ne_|fill"),
    ("copies / casts", r"copy|memcpy|memset|_to_copy|cat"),
)


def category(name: str) -> str:
    low = name.lower()
    return next((label for label, pattern in CATEGORIES if re.search(pattern, low)), "other")


def rows_of(n: int, context: int, per_row: int) -> list[Row]:
    return [Row(context, [100 + r], True, list(range(r * per_row, (r + 1) * per_row))) for r in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_ms(run, repeats: int) -> float:
    """Median ms of `run` with a sync after each (as the engine syncs every step on the picked ids)."""
    for _ in range(3):
        run()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1e3


def host_ms(run, repeats: int) -> float:
    """Median ms the host spends in `run` before it returns (a sync after each, untimed): with the GPU idle at
    the call, about how long the step's first kernel waits."""
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    sync()
    return sorted(times)[len(times) // 2] * 1e3


def kernel_times(run, repeats: int) -> tuple[dict[str, list], float]:
    """Per category: [kernels, total ms, {name: ms}] per call of `run`, from torch.profiler; and the
    host's ms per call to enqueue `run` (its CPU time before the GPU is waited on)."""
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        host = 0.0
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            host += time.perf_counter() - started
            sync()
    found: dict[str, list] = defaultdict(lambda: [0, 0.0, defaultdict(float)])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = found[category(event.name)]
        ms = event.time_range.elapsed_us() / 1e3 / repeats
        entry[0] += 1 / repeats
        entry[1] += ms
        entry[2][event.name] += ms
    return dict(found), host / repeats * 1e3


def weight_input(weight, rows: int) -> torch.Tensor:
    """Random input rows for a matmul weight of any form (a tensor or Meta's fp8 slices)."""
    held = weight.slices[0] if isinstance(weight, Fp8Weight) else weight
    dtype = torch.bfloat16 if isinstance(weight, Fp8Weight) else held.dtype
    return torch.randn(rows, weight.shape[1], dtype=dtype, device=held.device)


def weight_bytes_of(weight) -> int:
    if isinstance(weight, Fp8Weight):
        return sum(t.numel() * t.element_size() for t in (*weight.slices, *weight.scales))
    return weight.numel() * weight.element_size()


def matmul_alone_ms(model: torch.nn.Module, rows: int) -> tuple[float, int]:
    """The step's matmuls (every layer's and the output layer) at `rows` rows, on a GPU replayed from
    one CUDA graph so launches cost nothing: ms and the weight bytes they read."""
    weights = backend.matmul_weights(model)
    x = [weight_input(w, rows) for w in weights]
    run = lambda: [linear(xi, w) for xi, w in zip(x, weights)]  # noqa: E731
    if x[0].is_cuda:
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # cuBLAS's handles and workspaces made before the capture
            with torch.cuda.graph(graph):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        run = graph.replay
    return timed_ms(run, 20), sum(weight_bytes_of(w) for w in weights)


def longest(names: dict[str, float]) -> str:
    """A category's two longest kernels, their names cut to 60 characters, with their ms."""
    return "; ".join(f"{name[:60]} {t:.3f}" for name, t in sorted(names.items(), key=lambda item: -item[1])[:2])


def decode_profile(model, step: DecodeStep, rows: list[Row], floor_ms: float, bandwidth: float) -> None:
    n = len(rows)
    wall = timed_ms(lambda: step(rows), 30)
    found, host = kernel_times(lambda: step(rows), 10)
    enqueue = host_ms(lambda: step(rows), 30)
    size = next(b for b in step.sizes if b >= n)
    inputs = host_ms(lambda: step._inputs(rows, size), 30)
    parts = f"{inputs:.3f} building the inputs"
    captured = step.graphs.get(size)
    if captured is not None:  # the rest of the enqueue, each part alone
        host = step._inputs(rows, size)
        pinned = host.pin_memory()
        pin = host_ms(lambda: host.pin_memory(), 30)
        copy = host_ms(lambda: captured.inputs.copy_(pinned, non_blocking=True), 30)
        launch = host_ms(captured.graph.replay, 30)
        parts += f", {pin:.3f} pinning them, {copy:.3f} their copy, {launch:.3f} the graph's launch"
    busy = sum(entry[1] for entry in found.values())
    alone, weight_bytes = matmul_alone_ms(model, n)
    logits = step(rows)
    sample = timed_ms(lambda: logits.argmax(dim=-1).tolist(), 30)
    print(f"\n### {n} row(s): step {wall:.2f} ms with a sync (floor {floor_ms:.2f} ms, {floor_ms / wall:.0%}); "
          f"kernels {busy:.2f} ms; host enqueue {host:.2f} ms; greedy pick of the logits {sample:.2f} ms\n")
    print("| where | kernels a step | ms a step | share of the step | what |\n|---|---|---|---|---|")
    for label, (count, ms, names) in sorted(found.items(), key=lambda item: -item[1][1]):
        what = longest(names)
        if label == "matmul":
            what = (f"{weight_bytes / (ms * 1e-3) / 1e9:.0f} GB/s of weights in the step; the same matmuls alone "
                    f"{alone:.2f} ms ({weight_bytes / (alone * 1e-3) / 1e9:.0f} GB/s; copy {bandwidth / 1e9:.0f})")
        print(f"| {label} | {count:.0f} | {ms:.3f} | {ms / wall:.1%} | {what} |")
    gaps = wall - busy
    print(f"| GPU idle within the step (host, launch, sync) | | {gaps:.3f} | {gaps / wall:.1%} | host enqueue "
          f"{enqueue:.3f} ms unprofiled ({parts}), {host:.2f} profiled |")
    print(f"\naccounted: kernels {busy / wall:.0%} + idle {gaps / wall:.0%} of the step; sampling (greedy pick and "
          f"the ids to the host) {sample:.2f} ms more per step")


def dense_peak_tflops(device: torch.device, n: int) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = timed_ms(lambda: torch.mm(a, b), 10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def prefill_profile(model, args, length: int, cache, peak: float) -> None:
    blocks = list(range(-(-length // cache.block_size)))
    ids = [(7 * i) % (args.vocab_size - 1) + 1 for i in range(length)]
    spec = [(0, ids, True, blocks)]
    run = lambda: model(Batch.build(spec, cache.block_size, cache.spare, cache.k.device))  # noqa: E731
    with torch.inference_mode():
        ms = timed_ms(run, 5)
        found, _ = kernel_times(run, 2)
    layer_params = 2 * args.dim * args.n_heads * args.head_dim + 2 * args.dim * args.n_kv_heads * args.head_dim \
        + 3 * args.dim * args.ffn_dim
    flops = 2 * length * layer_params * args.n_layers + 2 * args.dim * args.vocab_size \
        + 2 * args.n_layers * length * length * args.n_heads * args.head_dim  # causal: half of QK^T and PV
    rate = flops / (ms * 1e-3) / 1e12
    print(f"\n### prompt of {length} tokens, one eager step: {ms:.1f} ms, {length / ms * 1e3:.0f} tokens/s, "
          f"{rate:.0f} TFLOP/s = {rate / peak:.0%} of the dense bfloat16 matmul's {peak:.0f} TFLOP/s\n")
    print("| where | kernels | ms | share | its two longest kernels (ms) |\n|---|---|---|---|---|")
    for label, (count, t, names) in sorted(found.items(), key=lambda item: -item[1][1]):
        print(f"| {label} | {count:.0f} | {t:.2f} | {t / ms:.1%} | {longest(names)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=512, help="KV positions each decode row attends over")
    parser.add_argument("--prompt", type=int, default=2048, help="tokens of the prompt step (0: none)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="a small model, not the 8B shape")
    parser.add_argument("--kv-block", type=int, default=16, help="positions per KV-cache block")
    parser.add_argument("--fp8", action="store_true",
                        help="the FFN of every layer but the first and last in float8 with row scales (Meta's 405B FP8)")
    a = parser.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no GPU visible to this process", file=sys.stderr)
        return 1
    os.environ["TP_LLAMA_MATMUL"] = "plain"  # what CUDA runs (on CPU, not the C kernels)
    started = time.perf_counter()
    args = SMALL if a.small else LLAMA3_8B
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    bandwidth = copy_bandwidth(device) if a.device == "cuda" else 1e10
    peak = dense_peak_tflops(device, 512 if a.small else 8192)
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: copy {bandwidth / 1e9:.0f} GB/s, bfloat16 matmul {peak:.0f} TFLOP/s; "
          f"the code of {Path(backend.__file__).parents[2]}")
    state = random_state(args, 0, device=a.device, dtype=torch.bfloat16)
    weight_bytes = sum(t.numel() * 2 for key, t in state.items() if key != "tok_embeddings.weight")
    info = DistInfo(0, 1, 0, device, "none")
    options: dict = {"kv_block_size": a.kv_block} if a.kv_block != 16 else {}  # older checkouts lack both
    saved = []
    if a.fp8:
        from checks import meta_matmuls  # here, not above: older checkouts, profiled with PYTHONPATH, lack it

        options["transform"] = lambda model: saved.append(meta_matmuls.fp8_feed_forward(model))
    model = served_engine(args, state, info, "bfloat16", "off", max(a.rows), max(a.context + 8, a.prompt + 16),
                          **options).model
    weight_bytes -= sum(saved)
    del state
    cache = model.layers[0].attention.cache
    per_row = -(-(a.context + 8) // cache.block_size)
    step = DecodeStep(model, max(a.rows), per_row, device, compiled=a.device == "cuda")
    compiling = time.perf_counter()
    step.warm_up(tuple(a.rows))
    print(f"compiled and captured {len(a.rows)} buckets in {time.perf_counter() - compiling:.0f} s; pool "
          f"{cache.pool_blocks} blocks of {cache.block_size}")
    kv_per_row = a.context * args.n_layers * 2 * args.n_kv_heads * args.head_dim * 2
    with torch.inference_mode():
        for n in a.rows:
            floor_ms = (weight_bytes + n * kv_per_row) / bandwidth * 1e3
            decode_profile(model, step, rows_of(n, a.context, per_row), floor_ms, bandwidth)
    if a.prompt:
        prefill_profile(model, args, a.prompt, cache, peak)
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
