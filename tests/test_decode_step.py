"""The capture-ready decode step (engine/decode_step.py) against the step it stands in for.

Rows in scattered blocks, at lengths on both sides of the cache's block size, padding to a
bucket: the same logits and the same KV cache as Batch.build's step, eager and compiled; the same
greedy tokens through the whole engine, at TP 1 and TP 2.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from tests.support.cli_util import launch_cli
from tests.support.run_model import BLOCK, setup_slots, slot_batch, slot_blocks
from tp_llama.backend import Preparation
from tp_llama.config import EngineConfig
from tp_llama.engine.runner import compiles_decode
from tp_llama.engine.decode_step import DecodeStep, bucket_sizes
from tp_llama.engine.plan import Row
from tp_llama.lora.slots import LoraStep
from tp_llama.model import ModelArgs, Transformer
from tp_llama.testing.synthetic import write_checkpoint

MAX_ROWS, MAX_SEQ = 8, 2 * BLOCK + 40
WIDTH = -(-MAX_SEQ // BLOCK)  # blocks per sequence
# slot -> tokens already in its cache: inside the first block, at its end, just past it, in the third
FILLED = {0: 5, 2: BLOCK - 1, 3: BLOCK, 5: BLOCK + 1, 6: 2 * BLOCK + 7}


def served_model(device: str) -> Transformer:
    """A small GQA model fused as served off the C kernels, its slots filled to FILLED."""
    torch.manual_seed(0)
    args = ModelArgs(dim=128, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=300, ffn_dim=192)
    model = Transformer(args).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    Preparation("plain", "", 16, torch.device(device)).apply(model)
    model.to(device)
    setup_slots(model, MAX_ROWS, MAX_SEQ, torch.float32, torch.device(device))
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for slot, length in FILLED.items():
            ids = torch.randint(0, args.vocab_size, (length,), generator=gen).tolist()
            model(slot_batch(model, [(slot, 0, ids, False)]))
    return model


def caches(model: Transformer) -> list[torch.Tensor]:
    return [t.clone() for layer in model.layers for t in (layer.attention.cache.k, layer.attention.cache.v)]


def restore(model: Transformer, saved: list[torch.Tensor]) -> None:
    live = [t for layer in model.layers for t in (layer.attention.cache.k, layer.attention.cache.v)]
    for target, value in zip(live, saved):
        target.copy_(value)


def decode_rows(model: Transformer) -> list[tuple[int, Row]]:
    """(slot, its decode row) for each filled slot."""
    return [(slot, Row(length, [17 + slot], True, slot_blocks(model, slot, length + 1)))
            for slot, length in FILLED.items()]


def batch_logits(model: Transformer, rows: list[tuple[int, Row]]) -> torch.Tensor:
    return model(slot_batch(model, [(slot, r.start, r.tokens, len(r.tokens)) for slot, r in rows]))


def verify_rows(model: Transformer) -> list[tuple[int, Row]]:
    """Rows carrying speculative proposals: inside a block, across a block boundary, none; 7 positions."""
    carried = {0: [40, 41], 2: [42, 43], 5: []}
    return [(slot, Row(FILLED[slot], [17 + slot, *more], True, slot_blocks(model, slot, FILLED[slot] + 1 + len(more)),
                       proposed=len(more))) for slot, more in carried.items()]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_decode_step_gives_the_batch_steps_logits_and_cache(device: str, compiled: bool):
    model = served_model(device)
    rows = decode_rows(model)
    before = caches(model)
    spare_at = model.layers[0].attention.cache.spare * BLOCK
    with torch.inference_mode():
        want = batch_logits(model, rows)
        want_cache = caches(model)
        restore(model, before)
        step = DecodeStep(model, MAX_ROWS, WIDTH, torch.device(device), compiled=compiled)
        got = step([r for _, r in rows])
        got_cache = caches(model)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        # Every block but the spare one padding rows write to, within float32 rounding: a matmul of 8 rows
        # (5 and padding) may block its sums otherwise than one of 5, and attention is another kernel.
        for g, w in zip(got_cache, want_cache):
            torch.testing.assert_close(g[:, :spare_at], w[:, :spare_at], rtol=0, atol=1e-5)
        # The same graph for other tables and lengths, in the same bucket of 8 (4 rows and 4 padding).
        restore(model, before)
        fewer = rows[1:]
        want_fewer = batch_logits(model, fewer)
        restore(model, before)
        torch.testing.assert_close(step([r for _, r in fewer]), want_fewer, rtol=0, atol=2e-5)
        # Rows carrying proposals, one padded row a position, in the same bucket: each position's logits as
        # Batch.build's verify rows give them, and its keys and values in the cache.
        restore(model, before)
        verify = verify_rows(model)
        want_verify = batch_logits(model, verify)
        want_cache = caches(model)
        restore(model, before)
        assert step.accepts([r for _, r in verify])
        torch.testing.assert_close(step([r for _, r in verify]), want_verify, rtol=0, atol=2e-5)
        for g, w in zip(caches(model), want_cache):
            torch.testing.assert_close(g[:, :spare_at], w[:, :spare_at], rtol=0, atol=1e-5)


def test_every_bucket_gets_its_own_graph_whatever_recompile_limit_it_finds(device: str, monkeypatch):
    """Dynamo counts all graphs of one function against one limit; past it, a bucket would run eagerly
    (on CUDA, FlexAttention then materialises scores over the whole pool: a 32-row step of an 8B
    model took 720 ms against 8 ms). Here a limit of 1 meets a step of 2 buckets. The limit is dynamo's, so on CPU
    its graphs run eagerly (backend "eager"); a CUDA graph cannot capture eager FlexAttention, so on CUDA inductor
    compiles them."""
    torch.compiler.reset()  # no graphs of earlier tests in the count
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    if device == "cpu":
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    model = served_model(device)
    compiled = counters["frames"]["ok"]
    step = DecodeStep(model, 2, WIDTH, torch.device(device), compiled=True)
    step.warm_up()
    assert step.sizes == (1, 2)
    assert counters["frames"]["ok"] - compiled == 2


def test_buckets_cover_every_row_count_up_to_the_cap():
    for cap in (1, 3, 16, 33, 300):
        sizes = bucket_sizes(cap)
        assert sizes[-1] == cap and list(sizes) == sorted(set(sizes))
        assert all(any(s >= n for s in sizes) for n in range(1, cap + 1))


def test_only_decode_only_steps_take_the_decode_step():
    plain, adapted = SimpleNamespace(lora=None, sizes=(8,)), SimpleNamespace(lora=LoraStep(), sizes=(8,))
    for step in (plain, adapted):
        assert DecodeStep.accepts(step, [Row(4, [1], True, [0]), Row(9, [2], True, [1])])
        assert not DecodeStep.accepts(step, [])
        assert not DecodeStep.accepts(step, [Row(4, [1], True, [0]), Row(0, [5, 6], True, [1])])
        assert not DecodeStep.accepts(step, [Row(4, [1], False, [0])])  # a one-token prompt chunk that samples nothing
        assert DecodeStep.accepts(step, [Row(4, [1, 7, 8], True, [0], proposed=2), Row(9, [2], True, [1])])
        assert not DecodeStep.accepts(step, [Row(4, [1, 7, 8], True, [0], proposed=1)])  # a prompt chunk's tail
        assert not DecodeStep.accepts(step, [Row(4, [1, 7, 8], True, [0], proposed=2)] * 3)  # past the largest bucket
    on_adapter = [Row(4, [1], True, [0], adapter=1)]  # only a graph built with the adapters' slots runs it
    assert DecodeStep.accepts(adapted, on_adapter) and not DecodeStep.accepts(plain, on_adapter)


def test_compiling_is_chosen_by_device_mode_and_kernels():
    config = EngineConfig("-")
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert compiles_decode(config, cuda, "plain") == (True, "")
    assert not compiles_decode(config, cpu, "onednn")[0]
    assert compiles_decode(EngineConfig("-", compile="on"), cpu, "onednn") == (True, "")
    assert not compiles_decode(EngineConfig("-", compile="on"), cpu, "amx")[0]
    assert not compiles_decode(EngineConfig("-", compile="on"), cuda, None)[0]  # fsdp
    assert not compiles_decode(EngineConfig("-", compile="off"), cuda, "plain")[0]
    with pytest.raises(ValueError, match="compile must be one of"):
        EngineConfig("-", compile="yes")


def test_compiled_decode_steps_generate_the_eager_tokens(tmp_path):
    """The whole engine at TP 2, compile on and off: the all-reduces traced, the logits' gather to rank 0
    after. One row at a time (one graph a rank: several rows in a compiled step, at TP 1, are the test
    above's)."""
    ckpt = write_checkpoint(tmp_path / "ckpt", family="llama3", mp=2)
    prompts = ["the lamp", "a keeper wrote the reading in the log at dusk"]
    outputs = {}
    for compile_ in ("off", "on"):
        args = ["--ckpt-dir", str(ckpt), "--dtype", "float32", "--max-new-tokens", "10", "--slots", "1",
                "--compile", compile_]
        for prompt in prompts:
            args += ["--prompt", prompt]
        run = launch_cli(args, 2, timeout=300, env={"TP_LLAMA_MATMUL": "plain"})
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"decode steps: {'compiled' if compile_ == 'on' else 'eager'}" in run.stderr
        outputs[compile_] = [json.loads(line)["token_ids"] for line in run.stdout.splitlines() if line.strip()]
    assert len(outputs["on"]) == len(prompts)
    assert outputs["on"] == outputs["off"]


def test_the_gpu_check_runs_here_on_cpu():
    """The GPU check (checks/gpu_check.py, run as `python -m bench.gpu_check`) runs for the first time on a
    lent GPU: keep it working meanwhile, its quantized rows (Meta's int4 matmuls on the CPU) too."""
    run = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quantized"], check=False,
                         capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    table = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 12 and all(line.endswith("| ok |") for line in table[1:]), run.stdout
