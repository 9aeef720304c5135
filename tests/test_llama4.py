"""Llama 4 (MoE, iRoPE) loaded from Meta's download layout, against Meta's own model (llama-models 0.3.0).

One small random config with every Llama 4 feature on (tests/support/meta_llama4.py: MoE every second
layer, a NoPE layer with temperature tuning, QK-norm, 32-position attention chunks), written at MP 1, 2
and 4 with the entries a loader must drop. The oracle is Meta's Transformer prefilling each prompt from
position 0 over fairscale; ours is loaded by each rank reading its own slices, at TP 1, 2 and 4 from
every relation of MP to TP. Meta's model applies the chunk mask only to a prefill, so our decode steps
are checked by prefilling Meta's model with the prompt and our greedy reply: each reply token must be
Meta's argmax at its position, up to near-ties.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tp_llama.checkpoint.loader import load_tp_model
from tp_llama.checkpoint.params import read_params
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.errors import CheckpointError
from tp_llama.parallel.distributed import DistInfo
from tp_llama.serving.metrics import EXPERT_TOKENS, ServingMetrics
from tp_llama.testing.tokenizer_train import build_tokenizer

from tests.support.dist_util import run_ranks
from tests.support.meta_llama4 import (META_VOCAB, is_moe_layer, meta_run, random_served, small_params,
                                       write_llama4_checkpoint)
from tests.support.run_model import dense_logits, setup_slots, slot_batch

# 8 heads over 4 KV heads: TP 1, 2 and 4 all divide them. 2,304 ids: the least a trained tokenizer has
# in Llama 4's format (256 byte-level tokens, then Llama 4's 2,048 special ids).
PARAMS = small_params(n_kv_heads=4, vocab_size=256 + 2048)
LENGTHS = (75, 40, 9)  # prompts across two chunk boundaries, across one, within the first chunk
NEAR_TIE = 1e-3  # a top-2 gap below this is one float32 may legitimately flip
CPU = DistInfo(0, 1, 0, torch.device("cpu"), "none")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One CPU thread: the models are tiny, and the C kernels' threads wait on each other manyfold whenever
    another process (the suite's other worker) holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The same weights at MP 1, 2 and 4, with Meta's non-parameter entries in every file."""
    root = tmp_path_factory.mktemp("llama4")
    folders = {mp: root / f"mp{mp}" for mp in (1, 2, 4)}
    for mp, folder in folders.items():
        write_llama4_checkpoint(folder, PARAMS, mp, seed=3, extra_entries=True)
    return folders


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, PARAMS["vocab_size"], (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def meta(checkpoints: dict[int, Path], prompts: list[list[int]]) -> list[torch.Tensor]:
    """Meta's logits at MP 2, informative enough to tell a wrong weight (spread, many different argmaxes)."""
    logits = meta_run(checkpoints[2], prompts, mp=2)["logits"]
    assert logits[0].std() > 1.0 and logits[0].argmax(-1).unique().numel() > 20
    return logits


def prefill_logits(folder: str, prompts: list[list[int]], info: DistInfo | None = None) -> list[torch.Tensor] | None:
    """Ours: each prompt prefilled from position 0 in float32 (None on ranks but 0, which gathers the logits)."""
    info = info or DistInfo(*_rank_and_world(), torch.device("cpu"), "gloo")
    model = load_tp_model(folder, read_params(folder), info, torch.float32)
    kv_heads = PARAMS["n_kv_heads"] // info.world_size
    setup_slots(model, 1, max(map(len, prompts)), torch.float32, info.device, kv_heads)
    out = [dense_logits(model, torch.tensor([p]), torch.tensor([0]), last_only=False)[0] for p in prompts]
    return out if info.rank == 0 else None


def _rank_and_world() -> tuple[int, int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), dist.get_rank()


def tp_logits(folders: list[Path], prompts: list[list[int]]) -> list | None:
    """Ours at this process group's TP size, from each folder in turn (one set of ranks for them all), as
    arrays: a tensor sent from a spawned rank is shared memory that dies with it."""
    got = [prefill_logits(str(folder), prompts) for folder in folders]
    return None if got[0] is None else [[t.numpy() for t in logits] for logits in got]


def assert_close(ours: list[torch.Tensor], theirs: list[torch.Tensor], label: str) -> None:
    for prompt, (a, b) in enumerate(zip(ours, theirs)):
        a = torch.as_tensor(a)
        assert a.shape == b.shape, label
        worst = (a - b).abs().max().item()
        assert worst < 1e-3 * b.abs().max().item(), f"{label}, prompt {prompt}: logits differ by {worst}"


def test_tp1_from_every_mp_matches_meta(checkpoints, prompts, meta):
    for mp, folder in checkpoints.items():
        assert_close(prefill_logits(str(folder), prompts, CPU), meta, f"MP {mp} -> TP 1")


def test_tp2_matches_meta(checkpoints, prompts, meta):
    """MP 1 < TP, MP 2 == TP and MP 4 > TP, each rank reading only its slices of the experts."""
    order = [1, 2, 4]
    got = run_ranks(tp_logits, 2, [checkpoints[mp] for mp in order], prompts, timeout=120)[0]
    for mp, logits in zip(order, got):
        assert_close(logits, meta, f"MP {mp} -> TP 2")


def test_tp4_matches_meta(checkpoints, prompts, meta):
    """The longest prompt only: four ranks on this machine's cores cost far more than their prompts."""
    got = run_ranks(tp_logits, 4, [checkpoints[2]], prompts[:1], timeout=120)[0]
    assert_close(got[0], meta[:1], "MP 2 -> TP 4")


def with_tokenizer(checkpoint: Path, tmp_path: Path) -> str:
    """A folder of the checkpoint's files and a trained tokenizer (256 base tokens, read in Llama 4's format)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for path in checkpoint.iterdir():
        (folder / path.name).symlink_to(path)
    build_tokenizer("llama3", folder / "tokenizer.model", 512)
    return str(folder)


def test_decode_across_chunks_matches_meta(checkpoints, prompts, tmp_path):
    """Our greedy replies (prompt chunks, then decode steps across chunk boundaries, batched and alone)
    are Meta's argmax at every position of a prefill of prompt + reply, up to near-ties; batched
    requests give the replies they give alone, and a prompt whose first chunks are cached the reply it
    gets cold."""
    engine = Engine.load(EngineConfig(with_tokenizer(checkpoints[1], tmp_path), "tp", "float32", max_seq_len=128,
                                      max_batch_size=4, prefill_budget=48))

    def replies(batch: list[list[int]], scheduler=None) -> list[list[int]]:
        scheduler = scheduler or engine.new_scheduler()
        scheduler.stop_ids = frozenset()
        seqs = [Sequence(str(i), p, SamplingParams(40)) for i, p in enumerate(batch)]
        for seq in seqs:
            scheduler.add(seq)
        engine.run(scheduler)
        return [seq.output for seq in seqs]

    together = replies(prompts)
    assert together == [replies([p])[0] for p in prompts]
    # The prefix cache serves the chunked layers too: a prompt sharing 48 positions (a chunk and a half) with
    # one seen before gets them from the cache, its second chunk's first 16 keys among them, and the tokens
    # it gets cold.
    warm = engine.new_scheduler()
    replies([prompts[0]], warm)
    hits = warm.prefix_hits
    assert replies([prompts[0][:48] + prompts[2]], warm) == replies([prompts[0][:48] + prompts[2]])
    assert warm.prefix_hits - hits == 48
    # Every token fed (each prompt's, then each reply's but its last), in both runs, was routed once per MoE layer.
    fed = 2 * sum(len(p) + len(r) - 1 for p, r in zip(prompts, together)) + len(prompts[0]) + 39
    fed += 2 * (48 + len(prompts[2]) + 39) - 48  # the shared prompt, cold and warm (its 48 cached positions not fed)
    per_layer: dict[int, int] = {}
    for (layer, _), count in engine.expert_tokens().items():
        per_layer[layer] = per_layer.get(layer, 0) + count
    assert per_layer == {layer: fed for layer in range(PARAMS["n_layers"]) if is_moe_layer(PARAMS, layer)}
    metrics = ServingMetrics(None, "llama4", 8)
    metrics.experts(engine.expert_tokens())
    metrics.flush()
    assert sum(n for (name, _), n in metrics.totals.items() if name == EXPERT_TOKENS) == fed * len(per_layer)
    full = [p + r for p, r in zip(prompts, together)]
    logits = meta_run(checkpoints[1], full, mp=1)["logits"]
    for prompt, reply, scores in zip(prompts, together, logits):
        for i, token in enumerate(reply):
            row = scores[len(prompt) - 1 + i]
            top2 = row.topk(2).values
            if row.argmax().item() != token:
                assert top2[0] - top2[1] < NEAR_TIE, f"reply token {i} of a {len(prompt)}-token prompt"
                break  # past a near-tie the two continuations differ


@pytest.mark.parametrize(("change", "named"), [
    ({"no_such_key": 1}, "no_such_key"),
    ({"moe_args": {"num_experts": 0, "top_k": 1}}, "moe_args.num_experts"),
    ({"moe_args": {"num_experts": 4, "top_k": 2}}, "moe_args.top_k"),
    ({"moe_args": {"num_experts": 4, "routing": "x"}}, "moe_args.routing"),
    ({"attention_chunk_size": -32}, "attention_chunk_size"),
    ({"quantization_args": {"scheme": "int4_weight_int8_dynamic_activation"}}, "quantized"),
])
def test_bad_params_name_the_key(tmp_path, change, named):
    (tmp_path / "params.json").write_text(json.dumps({**PARAMS, **change}))
    with pytest.raises(CheckpointError, match=named):
        read_params(tmp_path)


def test_scout_params_give_scouts_shapes(tmp_path):
    """Scout's params.json (its published values) gives its widths and its own RoPE scaling."""
    scout = {"dim": 5120, "ffn_exp": 4.0, "ffn_dim_multiplier": 1.2, "multiple_of": 2048, "n_heads": 40,
             "n_kv_heads": 8, "n_layers": 48, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True,
             "vocab_size": META_VOCAB, "nope_layer_interval": 4, "use_qk_norm": True, "attention_chunk_size": 8192,
             "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
             "moe_args": {"num_experts": 16, "capacity_factor": 1.0, "auto_scale_F": True, "top_k": 1,
                          "interleave_moe_layer_step": 1}}
    (tmp_path / "params.json").write_text(json.dumps({"model": scout}))
    args = read_params(tmp_path)
    assert (args.family, args.ffn_dim, args.moe.expert_dim, args.moe.experts) == ("llama4", 16384, 8192, 16)
    assert args.rope_scaling == (16.0, 1.0)
    assert [args.is_nope_layer(i) for i in range(4)] == [False, False, False, True]


def test_keys_left_out_take_metas_defaults(tmp_path):
    """A Llama 4 params.json without the keys llama-models gives defaults reads them as Meta's ModelArgs does."""
    from llama_models.llama4.args import ModelArgs as MetaArgs

    optional = ("rope_theta", "floor_scale", "attn_scale", "use_qk_norm", "attn_temperature_tuning")
    params = {key: value for key, value in PARAMS.items() if key not in optional}
    (tmp_path / "params.json").write_text(json.dumps(params))
    ours, theirs = read_params(tmp_path), MetaArgs(**params)
    assert [getattr(ours, key) for key in optional] == [getattr(theirs, key) for key in optional]


def test_served_modules_match_meta_and_keep_a_rows_bits(checkpoints, prompts, meta):
    """Prepared for serving (the C kernels' tiles where they run: fused q/k/v, gated w1/w3, one weight per
    expert, the router on the same kernels): Meta's logits still, and a row's logits have the same bits
    alone as beside other rows (its expert chosen and computed without them)."""
    from tp_llama import backend

    folder = str(checkpoints[1])
    model = load_tp_model(folder, read_params(folder), CPU, torch.float32,
                          backend.preparation_for(CPU.device, torch.float32))
    setup_slots(model, 3, max(map(len, prompts)), torch.float32, CPU.device)
    assert_close([dense_logits(model, torch.tensor([p]), torch.tensor([0]), last_only=False)[0] for p in prompts],
                 meta, "served modules")
    alone = [dense_logits(model, torch.tensor([p[:9]]), torch.tensor([0]), first_slot=i) for i, p in enumerate(prompts)]
    together = dense_logits(model, torch.tensor([p[:9] for p in prompts]), torch.tensor([0, 0, 0]))
    assert all(torch.equal(a[0], b) for a, b in zip(alone, together))


def test_grouped_experts_and_the_static_decode_step_match(checkpoints, prompts, meta, monkeypatch):
    """PyTorch's matmuls as on a GPU (`plain`): the experts in two grouped matmuls give Meta's logits, and the
    decode step at static shapes that CUDA graphs capture (block masks per window, no host sync), run
    here uncompiled, gives the logits of an ordinary step for rows on both sides of a chunk boundary."""
    from tp_llama import backend
    from tp_llama.engine.decode_step import DecodeStep
    from tp_llama.engine.plan import Row
    from tests.support.run_model import slot_batch, slot_blocks

    monkeypatch.setenv("TP_LLAMA_MATMUL", "plain")
    folder = str(checkpoints[1])
    plan = backend.preparation_for(CPU.device, torch.float32)
    model = load_tp_model(folder, read_params(folder), CPU, torch.float32, plan)
    assert plan.kind == "plain" and all(layer.feed_forward.grouped for layer in model.layers[1::2])
    setup_slots(model, 3, 80, torch.float32, CPU.device)
    with torch.inference_mode():
        prefilled = [dense_logits(model, torch.tensor([p]), torch.tensor([0]), first_slot=i, last_only=False)[0]
                     for i, p in enumerate(prompts)]
        assert_close(prefilled, meta, "grouped experts")
        rows = [Row(len(p), [p[0]], True, slot_blocks(model, i, len(p) + 1)) for i, p in enumerate(prompts)]
        want = model(slot_batch(model, [(i, r.start, r.tokens, True) for i, r in enumerate(rows)]))
        step = DecodeStep(model, 4, slot_blocks(model, 0, 80)[-1] + 1, CPU.device, compiled=False)
        assert step.windows == (PARAMS["attention_chunk_size"],)
        torch.testing.assert_close(step(rows), want, rtol=0, atol=1e-4)



def test_llama4_refuses_lora_and_compiles_only_where_it_can(checkpoints):
    """Adapters on Llama 4 fail the load saying what to remove; its decode steps compile in bfloat16 with
    chunks of whole KV blocks only (grouped matmuls want bfloat16, the step's block masks whole blocks)."""
    from tp_llama.engine.runner import compiles_decode
    from tp_llama.lora.adapters import AdapterError
    from tp_llama.lora.serve import resident_adapters

    args = read_params(checkpoints[1])
    config = EngineConfig(str(checkpoints[1]), "tp", "float32", lora_runtime_loading=True, lora_folder="/adapters")
    with pytest.raises(AdapterError, match="Llama 4.*lora_runtime_loading"):
        resident_adapters(config, None, args, CPU, torch.float32)
    cuda, on = torch.device("cuda"), EngineConfig("-", compile="on")
    assert compiles_decode(on, cuda, "plain", args, torch.bfloat16) == (True, "")
    assert "bfloat16" in compiles_decode(on, cuda, "plain", args, torch.float32)[1]
    odd = dataclasses.replace(args, attention_chunk_size=40)
    assert "40" in compiles_decode(on, cuda, "plain", odd, torch.bfloat16)[1]


def test_chunks_of_no_whole_number_of_kv_blocks_attend_in_pytorch_and_say_so(checkpoints, tmp_path, capfd):
    """32-position chunks in blocks of 48: the C kernels' attention reads whole blocks from a window's first,
    so PyTorch's attends (its bits batch-dependent), the load says so, and the greedy reply is a load's in blocks
    of 16 (C attention)."""
    folder = with_tokenizer(checkpoints[1], tmp_path)
    replies = {}
    for block in (16, 48):
        engine = Engine.load(EngineConfig(folder, "tp", "float32", max_seq_len=96, kv_block_size=block))
        said = capfd.readouterr().err
        assert ("attention: PyTorch's" in said) == (block == 48), said
        seq = Sequence("a", list(range(3, 43)), SamplingParams(8, ignore_eos=True))
        engine.generate([seq])
        replies[block] = seq.output
    assert replies[48] == replies[16]


@torch.inference_mode()
def test_bfloat16_prompt_blocks_within_windows_match_pytorchs_attention():
    """Heads of 64 in bfloat16: prompt chunks through prompt_attention.c a piece per 32-position window, decode
    rows within theirs (backend/llama4.py). The reference is the same weights in float32 attending through
    PyTorch's masked attention (kv_cache.attend): the logits of chunks that start and end inside windows, and
    of a decode step past them, agree up to bfloat16's rounding."""
    dense = {**small_params()["moe_args"], "interleave_moe_layer_step": 8}  # no layer's expert choice to flip
    params = small_params(vocab_size=256, dim=512, moe_args=dense)
    served, reference = (random_served(params, dtype, 2, 96) for dtype in (torch.bfloat16, torch.float32))
    if not all(layer.attention.in_c for layer in served.layers):
        pytest.skip("the C kernels do not run here (tests/test_kernels.py says why)")
    for layer in reference.layers:
        layer.attention.in_c = False
    gen = torch.Generator().manual_seed(4)
    long, short = (torch.randint(0, 256, (n,), generator=gen).tolist() for n in (70, 40))
    steps = [[(0, 0, long[:7], True), (1, 0, short, True)], [(0, 7, long[7:40], True)], [(0, 40, long[40:], True)],
             [(0, 70, [5], True), (1, 40, [9], True)]]
    for i, rows in enumerate(steps):
        ours, theirs = (model(slot_batch(model, rows, all_logits=True)).float() for model in (served, reference))
        worst = (ours - theirs).abs().max().item()
        assert worst < 0.02 * theirs.abs().max().item(), f"step {i}: logits differ by {worst}"
