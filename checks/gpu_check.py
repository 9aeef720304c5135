"""The GPU check: `python -m bench.gpu_check` from the repository root, on a machine with one GPU
(bench/gpu_check.py runs this file; `python -m checks.gpu_check` is the same).

Needs only PyTorch (2.11 or newer) and this folder: no install, no TorchServe, no Java, no
network, nothing written to disk. Random weights are made in memory. It checks, and prints one
table of:

1. parity on the GPU against the float64 CPU reference (tests/support/reference.py): float32
   logits within 1e-3 and greedy tokens identical, bfloat16 logits within 5% of the logit scale;
   prefill and a decode step, with eager steps and with compiled (CUDA-graph) decode steps;
   and steps whose rows carry speculative decoding's proposals (the reference's own tokens: every one
   must be taken); and a Llama 4 (MoE, iRoPE) against its own float32 run on the CPU, compiled too;
2. TP 2: two ranks over gloo sharing the one GPU (NCCL wants a GPU per rank), greedy tokens;
3. NCCL at world size 1: the model's collectives on CUDA tensors, then greedy tokens;
4. decode speed on a Llama 3 8B-shaped model in bfloat16: ms per step at 1/8/32 rows, eager and
   captured, against the floor of reading the weights and KV cache once at the measured bandwidth.

--quantized adds rows for weights quantized at load (`quantize: int8 / int4`, PyTorch's ops on
CUDA): parity of each against the float64 reference on the dequantized weights (int8 in float32,
eager and compiled; int4, whose CUDA op takes bfloat16 only, in bfloat16), and the 8B captured decode
step at 1 row against the bfloat16 captured step (targets: int8 at most 0.7x its time, int4 0.55x);
and the matmuls of Meta's quantized downloads (checks/meta_matmuls.py).

Exit status 1 when a check fails. `--device cpu --skip-speed` runs checks 1-2 on CPU (as the tests do).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checks import meta_matmuls
from tests.support.proposals import Scripted
from tests.support.reference import Config, ReferenceModel, greedy
from tp_llama.checkpoint.loader import build_local_model
from tp_llama.kernels.quant import dequantize, quantize
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.decode_step import DecodeStep
from tp_llama.engine.plan import Row
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.model import ModelArgs, Transformer
from tp_llama.model.args import MoEArgs
from tp_llama.model.batch import Batch
from tp_llama.parallel.distributed import DistInfo, init_distributed
from tp_llama.parallel.layout import full_shapes, shard_dim
from tp_llama.parallel.modules import all_gather_last_dim, all_reduce_sum, gather_last_dim_to_rank0

SMALL = ModelArgs(dim=256, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=1024, ffn_dim=640, rope_theta=500000.0,
                  use_scaled_rope=True, family="llama3")
LLAMA3_8B = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336,
                      rope_theta=500000.0, use_scaled_rope=True, family="llama3")
LLAMA4 = ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=1024, ffn_dim=640, rope_theta=500000.0,
                   family="llama4", moe=MoEArgs(4, 256, interleave=2), nope_layer_interval=4, use_qk_norm=True,
                   attention_chunk_size=16, attn_temperature_tuning=True, floor_scale=8.0)
QUANTIZED_TARGETS = {"int8": 0.7, "int4": 0.55}  # a 1-row captured step's time over bfloat16's
MATMULS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")
PROMPTS = [[1, 17, 300, 45, 9, 800, 3], [1, 5], [1, 900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910, 2, 77]]
NEW_TOKENS = 12
ROWS = []  # the table: (check, setting, result, verdict)


class NoText:
    """The engine asks its tokenizer only for stop ids (these runs have none) and its id count (the
    engine picks no id past it: here any id of the model's)."""

    stop_ids: frozenset[int] = frozenset()
    n_words: int = sys.maxsize


def random_state(args: ModelArgs, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Weights in Meta's names, scaled so activations and logits stay of order one."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for key, shape in full_shapes(args).items():
        if key.endswith("norm.weight"):
            state[key] = 1 + 0.1 * torch.randn(shape, generator=gen, device=device)
        else:
            fan_in = shape[0] if ".experts." in key or "router" in key else shape[-1]  # Llama 4's x @ W tensors
            std = 1.0 if key == "tok_embeddings.weight" else fan_in ** -0.5
            state[key] = torch.randn(shape, generator=gen, device=device) * std
        state[key] = state[key].to(dtype)
    return state


def reference_of(args: ModelArgs, state: dict) -> ReferenceModel:
    cfg = Config(args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size, args.ffn_dim, args.norm_eps,
                 args.rope_theta, args.use_scaled_rope)
    return ReferenceModel(cfg, {key: value.double() for key, value in state.items()})


def dequantized(state: dict, bits: int, dtype: str) -> dict:
    """The weights an engine in `dtype` quantizes its matmuls' to stand for, in float64 (one rank: each
    weight quantized whole; int4 keeps the output layer in int8)."""
    def stands_for(key: str, value: torch.Tensor) -> torch.Tensor:
        if key.split(".")[-2] not in MATMULS:
            return value.double()
        return dequantize(quantize(value.to(getattr(torch, dtype)), 8 if key == "output.weight" else bits))

    return {key: stands_for(key, value) for key, value in state.items()}


def served_engine(args: ModelArgs, state: dict, info: DistInfo, dtype: str, compile_: str, max_rows: int = 4,
                  max_seq_len: int = 256, quantize_: str = "none", kv_block_size: int = 16,
                  transform: Callable[[Transformer], None] | None = None, speculative: str = "off") -> Engine:
    """The engine the CLI and the handler serve, on weights from memory (this rank's shards of `state`);
    transform: applied to the model as built, before the engine prepares it (Meta's fp8 layers, say)."""
    tp = info.world_size
    local = {}
    for key, tensor in state.items():
        dim = shard_dim(key, args.family) if tp > 1 else None
        local[key] = (tensor if dim is None else tensor.chunk(tp, dim)[info.rank]).to(getattr(torch, dtype)).contiguous()
    model = build_local_model(args, local, tp, dist.group.WORLD if tp > 1 else None)
    if transform is not None:
        transform(model)
    # A pool of max_rows sequences of max_seq_len (the default would take most of the GPU).
    token_bytes = 2 * args.n_layers * args.n_kv_heads // tp * args.head_dim * getattr(torch, dtype).itemsize
    config = EngineConfig("-", "tp", dtype, max_seq_len, max_rows, prefill_budget=max_seq_len,
                          device=info.device.type, compile=compile_, quantize=quantize_, kv_block_size=kv_block_size,
                          speculative=speculative,
                          kv_cache_memory_gb=(max_rows + 1) * (max_seq_len + kv_block_size) * token_bytes / 2**30)
    return Engine.from_model(config, model, NoText(), args, info, time.perf_counter())


def greedy_tokens(engine: Engine) -> list[list[int]]:
    sequences = [Sequence(str(i), ids, SamplingParams(NEW_TOKENS, ignore_eos=True)) for i, ids in enumerate(PROMPTS)]
    return [seq.output for seq in engine.generate(sequences)]


def step_logits(engine: Engine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a prefill of ids[:-1] (every position) and of the decode step of ids[-1], in the first blocks."""
    device, cache = engine.device, engine.cache
    blocks = list(range(-(-len(ids) // cache.block_size)))
    with torch.inference_mode():
        prefill = engine.model(Batch.build([(0, ids[:-1], True, blocks)], cache.block_size, cache.spare, device,
                                           all_logits=True))
        row = Row(len(ids) - 1, ids[-1:], True, blocks)
        if engine.decode_step is not None:
            decode = engine.decode_step([row])
        else:
            decode = engine.model(Batch.build([(row.start, row.tokens, True, row.blocks)], cache.block_size,
                                              cache.spare, device))
    return prefill.float().cpu(), decode.float().cpu()


def record(check: str, setting: str, result: str, ok: bool) -> bool:
    ROWS.append((check, setting, result, "ok" if ok else "FAIL"))
    print(f"  {check} | {setting} | {result} | {'ok' if ok else 'FAIL'}", file=sys.stderr, flush=True)
    return ok


def record_tokens(check: str, setting: str, got: list[list[int]], want: list[list[int]]) -> bool:
    same = sum(g == w for g, w in zip(got, want))
    return record(check, setting, f"{same}/{len(PROMPTS)} prompts' greedy tokens identical", same == len(PROMPTS))


@dataclass
class Expected:
    """The small model's weights and what the float64 reference makes of them, computed once for every check."""

    state: dict
    reference: ReferenceModel
    tokens: list[list[int]]

    @classmethod
    def small(cls) -> Expected:
        state = random_state(SMALL, 0)
        ref = reference_of(SMALL, state)
        return cls(state, ref, [greedy(ref, ids, NEW_TOKENS, frozenset(), ignore_eos=True).token_ids for ids in PROMPTS])


def parity(device: str, expected: Expected) -> None:
    ids = PROMPTS[2]
    want = expected.reference.logits(ids)
    scale = want.abs().max().item()
    info = DistInfo(0, 1, 0, torch.device(device), "none")
    # On CPU (the tests' run) one row at a time and eager only: each graph takes inductor tens of seconds
    # there, and tests/test_decode_step.py checks the compiled steps and their buckets.
    rows = 4 if device == "cuda" else 1
    for dtype in ("float32", "bfloat16"):
        for compile_ in ("off", "on") if device == "cuda" else ("off",):
            engine = served_engine(SMALL, expected.state, info, dtype, compile_, max_rows=rows)
            prefill, decode = step_logits(engine, ids)
            error = max((prefill - want[:-1]).abs().max().item(), (decode[0] - want[-1]).abs().max().item())
            setting = f"{device} {dtype} decode {'compiled' if compile_ == 'on' else 'eager'}"
            if dtype == "float32":
                record("parity: logits", setting, f"max abs diff {error:.2e} (limit 1e-3)", error < 1e-3)
                record_tokens("parity: greedy tokens", setting, greedy_tokens(engine), expected.tokens)
            else:
                share = error / scale
                record("parity: logits", setting, f"max abs diff {share:.1%} of the logit scale {scale:.1f} (limit 5%)",
                       share < 0.05)


class ReferenceProposals(Scripted):
    """Proposes the float64 reference's own greedy continuation, 4 tokens a row at every step: a verify
    step whose positions score as decode steps do takes every one."""

    def __init__(self, tokens: list[list[int]]):
        super().__init__()
        self.want = tokens

    def propose(self, seq_id: str, tokens: list[int], most: int) -> list[int]:
        done = len(tokens) - len(PROMPTS[int(seq_id)])
        return self.want[int(seq_id)][done : done + min(most, self.tokens)]


def speculative_parity(device: str, expected: Expected) -> None:
    """Rows carrying proposals (speculative decoding's verify steps) on the device: greedy tokens as the
    reference's, every proposal taken; compiled, the verify steps run in the decode step's graphs (a padded
    row a position)."""
    info = DistInfo(0, 1, 0, torch.device(device), "none")
    for compile_ in ("off", "on") if device == "cuda" else ("off",):
        engine = served_engine(SMALL, expected.state, info, "float32", compile_, speculative="ngram")
        verify_steps = [0, 0]  # steps carrying proposals, and those the compiled decode step took
        step = engine.decode_step
        if step is not None:
            def accepts(rows: list[Row], takes=step.accepts) -> bool:
                verifies, taken = any(row.proposed for row in rows), takes(rows)
                verify_steps[0] += verifies
                verify_steps[1] += verifies and taken
                return taken
            step.accepts = accepts
        scheduler, proposer = engine.new_scheduler(), ReferenceProposals(expected.tokens)
        scheduler.speculator = proposer
        sequences = [Sequence(str(i), ids, SamplingParams(NEW_TOKENS, ignore_eos=True)) for i, ids in enumerate(PROMPTS)]
        for seq in sequences:
            scheduler.add(seq)
        engine.run(scheduler)
        setting = f"{device} float32 decode {'compiled' if compile_ == 'on' else 'eager'}, the reference's proposals"
        record_tokens("speculative: greedy tokens", setting, [seq.output for seq in sequences], expected.tokens)
        record("speculative: proposals taken", setting, f"{proposer.accepted} of {proposer.proposed}",
               proposer.proposed > 0 and proposer.accepted == proposer.proposed)
        if step is not None:
            record("speculative: verify steps in the decode graphs", setting, "{1} of {0}".format(*verify_steps),
                   verify_steps[0] > 0 and verify_steps[1] == verify_steps[0])


def llama4_parity(device: str) -> None:
    """Llama 4 (MoE, iRoPE: a NoPE layer, 16-position chunks) on the device against the same weights on the
    CPU in float32, eager (checked against Meta's model by tests/test_llama4.py): float32 and bfloat16, the
    bfloat16 decode step also compiled (grouped experts, windowed block masks, a CUDA graph)."""
    state, ids = random_state(LLAMA4, 1), PROMPTS[2] + PROMPTS[0]  # 21 positions: across a chunk boundary
    cpu = served_engine(LLAMA4, state, DistInfo(0, 1, 0, torch.device("cpu"), "none"), "float32", "off")
    want_prefill, want_decode = step_logits(cpu, ids)
    scale = want_prefill.abs().max().item()
    info = DistInfo(0, 1, 0, torch.device(device), "none")
    settings = [("float32", "off"), ("bfloat16", "off"), ("bfloat16", "on")] if device == "cuda" else [("float32", "off")]
    for dtype, compile_ in settings:
        prefill, decode = step_logits(served_engine(LLAMA4, state, info, dtype, compile_), ids)
        share = max((prefill - want_prefill).abs().max().item(), (decode - want_decode).abs().max().item()) / scale
        limit = 1e-4 if dtype == "float32" else 0.05
        record("llama4: logits", f"{device} {dtype} decode {'compiled' if compile_ == 'on' else 'eager'}",
               f"max abs diff {share:.1e} of the logit scale {scale:.1f} (limit {limit:g})", share < limit)


def _tp_rank(rank: int, port: int, device: str, out: str) -> None:
    os.environ["TP_LLAMA_MATMUL"] = "plain"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    if device == "cuda":
        torch.cuda.set_device(0)
    info = DistInfo(rank, 2, rank, torch.device(device, 0) if device == "cuda" else torch.device(device), "gloo")
    engine = served_engine(SMALL, random_state(SMALL, 0), info, "float32", "off")
    tokens = greedy_tokens(engine)
    if rank == 0:
        Path(out).write_text(json.dumps(tokens))
    dist.destroy_process_group()


def tp2_over_gloo(device: str, expected: Expected) -> None:
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "tokens.json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = mp.start_processes(_tp_rank, args=(port, device, out), nprocs=2, join=False, start_method="spawn")
        deadline = time.monotonic() + 300
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                record("TP 2 over gloo", f"{device}, 2 ranks", "timed out after 300 s", False)
                return
        got = json.loads(Path(out).read_text())
    record_tokens("TP 2 over gloo", f"{device}, 2 ranks, float32", got, expected.tokens)


def nccl_world_one(expected: Expected) -> None:
    info = init_distributed("cuda", require_group=True)
    x = torch.randn(3, 8, device=info.device)
    collectives_ok = (info.backend == "nccl" and torch.equal(all_reduce_sum(x.clone(), None), x)
                      and torch.equal(all_gather_last_dim(x, None), x) and torch.equal(gather_last_dim_to_rank0(x, None), x))
    record("NCCL world 1", "all_reduce, all_gather, gather", f"backend {info.backend}", collectives_ok)
    record_tokens("NCCL world 1", "float32, compiled decode",
                  greedy_tokens(served_engine(SMALL, expected.state, info, "float32", "on")), expected.tokens)
    dist.destroy_process_group()


def quantized_parity(device: str, expected: Expected) -> None:
    """Each quantized format against the float64 reference on its dequantized weights."""
    ids = PROMPTS[2]
    info = DistInfo(0, 1, 0, torch.device(device), "none")
    for bits, dtype in ((8, "float32"), (4, "bfloat16")):
        want = reference_of(SMALL, dequantized(expected.state, bits, dtype)).logits(ids)
        scale = want.abs().max().item()
        for compile_ in ("off", "on") if device == "cuda" else ("off",):
            engine = served_engine(SMALL, expected.state, info, dtype, compile_, max_rows=1, quantize_=f"int{bits}")
            prefill, decode = step_logits(engine, ids)
            error = max((prefill - want[:-1]).abs().max().item(), (decode[0] - want[-1]).abs().max().item())
            setting = f"{device} int{bits} {dtype} decode {'compiled' if compile_ == 'on' else 'eager'}"
            if dtype == "float32":
                record("quantized parity: logits", setting, f"max abs diff {error:.2e} (limit 1e-3)", error < 1e-3)
            else:
                record("quantized parity: logits", setting,
                       f"max abs diff {error / scale:.1%} of the logit scale {scale:.1f} (limit 5%)", error / scale < 0.05)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a device-to-device copy of 2 GiB moves (read plus write)."""
    src = torch.empty(2**30, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() * 2 / (time.perf_counter() - started)


def step_ms(run, steps: int) -> float:
    """ms per call of `run` (a decode step), after 3 unmeasured ones."""
    with torch.inference_mode():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps * 1e3


def quantized_speed(context: int, steps: int, bf16_ms: float) -> None:
    """The 8B captured decode step at 1 row with int8 and int4 weights, against bfloat16's."""
    device = torch.device("cuda", 0)
    info = DistInfo(0, 1, 0, device, "none")
    for name, target in QUANTIZED_TARGETS.items():
        state = random_state(LLAMA3_8B, 0, device="cuda", dtype=torch.bfloat16)
        model = served_engine(LLAMA3_8B, state, info, "bfloat16", "off", 1, context + 8, quantize_=name).model
        del state
        cache = model.layers[0].attention.cache
        per_row = -(-(context + 8) // cache.block_size)
        captured = DecodeStep(model, 1, per_row, device, compiled=True)
        captured.warm_up((1,))
        row = [Row(context, [100], True, list(range(per_row)))]
        ms = step_ms(lambda step=captured, rows=row: step(rows), steps)
        record(f"decode speed 8B {name}", f"1 row, captured, context {context}",
               f"{ms:.2f} ms/step, {ms / bf16_ms:.2f}x bfloat16's {bf16_ms:.2f} ms (target {target}x)",
               ms / bf16_ms <= target)
        del model, captured  # before the next format's weights take the GPU's memory
        torch.cuda.empty_cache()


def decode_speed(sizes: tuple[int, ...], context: int, steps: int) -> float:
    """Records the bfloat16 8B rows; returns the captured 1-row step's ms (for the quantized rows)."""
    device = torch.device("cuda", 0)
    bandwidth = copy_bandwidth(device)
    info = DistInfo(0, 1, 0, device, "none")
    state = random_state(LLAMA3_8B, 0, device="cuda", dtype=torch.bfloat16)
    weight_bytes = sum(t.numel() * 2 for key, t in state.items() if key != "tok_embeddings.weight")
    # Eager here ("off"): the captured step below is built on the same model and cache, for the sizes asked.
    model = served_engine(LLAMA3_8B, state, info, "bfloat16", "off", max(sizes), context + 8).model
    del state
    started = time.perf_counter()
    cache = model.layers[0].attention.cache
    per_row = -(-(context + 8) // cache.block_size)
    captured = DecodeStep(model, max(sizes), per_row, device, compiled=True)  # the same model and cache as the eager steps
    captured.warm_up(tuple(sizes))
    compile_s = time.perf_counter() - started
    one_row_ms = float("nan")
    kv_per_row = context * LLAMA3_8B.n_layers * 2 * LLAMA3_8B.n_kv_heads * LLAMA3_8B.head_dim * 2
    for rows_n in sizes:
        rows = [Row(context, [100 + r], True, list(range(r * per_row, (r + 1) * per_row))) for r in range(rows_n)]
        floor_ms = (weight_bytes + rows_n * kv_per_row) / bandwidth * 1e3
        batch_rows = [(r.start, r.tokens, True, r.blocks) for r in rows]
        for name, run in (("eager", lambda spec=batch_rows: model(Batch.build(spec, cache.block_size, cache.spare,
                                                                               device))),
                          ("captured", lambda rows=rows: captured(rows))):
            ms = step_ms(run, steps)
            if rows_n == 1 and name == "captured":
                one_row_ms = ms
            record("decode speed 8B bf16", f"{rows_n} rows, {name}, context {context}",
                   f"{ms:.2f} ms/step, floor {floor_ms:.2f} ms ({floor_ms / ms:.0%})", True)
    record("decode speed 8B bf16", "setup", f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, compile {compile_s:.0f} s, "
           f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", True)
    return one_row_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--skip-speed", action="store_true", help="leave out the 8B decode benchmark")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=512, help="KV positions each row attends over")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quantized", action="store_true", help="add the int8 / int4 rows")
    a = parser.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no GPU visible to this process", file=sys.stderr)
        return 1
    os.environ.setdefault("TP_LLAMA_COLLECTIVE_TIMEOUT_S", "60")
    os.environ["TP_LLAMA_MATMUL"] = "plain"  # what CUDA runs; on CPU, the path compile applies to
    started = time.perf_counter()
    expected = Expected.small()
    parity(a.device, expected)
    speculative_parity(a.device, expected)
    llama4_parity(a.device)
    if a.quantized:
        quantized_parity(a.device, expected)
        meta_matmuls.rows(a.device, record)
    tp2_over_gloo(a.device, expected)
    if a.device == "cuda":
        nccl_world_one(expected)
        if not a.skip_speed:
            bf16_ms = decode_speed(tuple(a.sizes), a.context, a.steps)
            torch.cuda.empty_cache()
            if a.quantized:
                quantized_speed(a.context, a.steps, bf16_ms)
    print("| check | setting | result | |\n|---|---|---|---|")
    for row in ROWS:
        print("| " + " | ".join(row) + " |")
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    return 0 if all(row[3] == "ok" for row in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
