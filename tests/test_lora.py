"""LoRA adapters served: the engine's greedy replies on each adapter equal PEFT's on transformers' model of the
same random base (TP 1 and 2, MP 1 and 2), rows of several adapters and the base batch together with each
row's bits unchanged, and a prefix cached under one adapter's weights is never served to another's rows."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.support.dist_util import run_ranks
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.sequence import Sequence
from tp_llama.testing.synthetic import write_checkpoint

NEW_TOKENS = 8
# PEFT configs: q/k/v/o only and all seven modules, ranks 8 and 16, lora_alpha unlike r, rsLoRA on and off on
# the same factors (seed), so the two differ only by their scale.
ADAPTERS = {
    "qkvo8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all16": dict(r=16, lora_alpha=8, target_modules="all-linear"),
    "all16rs": dict(r=16, lora_alpha=8, target_modules="all-linear", use_rslora=True),
}
PROMPTS = [[1, 17, 230, 45, 99, 310, 7], [1, 400, 12, 12, 64], [1, 5, 6, 7, 8, 9, 10, 11, 12, 200, 201]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The base at MP 1 and MP 2, each adapter in PEFT's files (torchtune's too for qkvo8), and PEFT's greedy
    tokens for every prompt on the base and each adapter. (PEFT is imported here, not by the ranks spawned.)"""
    from tests.support import peft_reference as ref

    root = tmp_path_factory.mktemp("lora")
    args, state = ref.write_base(root / "mp1")
    write_checkpoint(root / "mp2", mp=2, dtype=torch.float32, seed=0, **ref.BASE_SHAPE)  # the same weights
    folders, expected = {}, {None: [greedy(ref.hf_model(state, args), p) for p in PROMPTS]}
    for name, config in ADAPTERS.items():
        model = ref.save_peft(state, args, root / name, seed=1, **config)
        folders[name] = str(root / name)
        expected[name] = [greedy(model, p) for p in PROMPTS]
    ref.write_torchtune(root / "qkvo8", root / "tune", args)
    folders["tune"] = {"path": str(root / "tune"), "lora_alpha": 16}
    expected["tune"] = expected["qkvo8"]
    return root, folders, expected


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    """transformers' forward over the whole sequence at each step, its last position's argmax taken."""
    ids = list(prompt)
    for _ in range(NEW_TOKENS):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def settings(ckpt, folders: dict, **extra) -> EngineConfig:
    options = {"dtype": "float32", "max_seq_len": 64, "max_batch_size": 16, "prefill_budget": 64, **extra}
    return EngineConfig(str(ckpt), lora_adapters=folders, **options)


def replies(engine: Engine, names: list, logprobs: int | None = None) -> list[Sequence]:
    """Every prompt on each of `names` (None: the base), all in one batch."""
    params = SamplingParams(NEW_TOKENS, ignore_eos=True, logprobs=logprobs)
    seqs = [Sequence(f"{name}-{i}", p, params, adapter=name) for name in names for i, p in enumerate(PROMPTS)]
    return engine.generate(seqs)


def assert_replies_equal_peft(engine: Engine, expected: dict, names: list) -> None:
    """Every prompt on each of `names`, in one batch, gets PEFT's greedy tokens."""
    seqs = replies(engine, names)
    assert {name: [s.output for s in seqs if s.adapter == name] for name in names} == {n: expected[n] for n in names}


def test_greedy_replies_equal_peft_on_every_adapter_batched_with_the_base(served):
    root, folders, expected = served
    assert_replies_equal_peft(Engine.load(settings(root / "mp1", folders)), expected, [None, *folders])
    # Each adapter changes the base's replies, and rsLoRA's scale changes the adapter's: else equality proves little.
    assert all(expected[name] != expected[None] for name in ADAPTERS)
    assert expected["all16"] != expected["all16rs"]


def _tp_replies(ckpt: str, folders: dict) -> dict:
    seqs = replies(Engine.load(settings(ckpt, folders)), [None, *folders])
    return {f"{s.adapter}": s.output for s in seqs if s.id.endswith("-0")}


@pytest.mark.parametrize("mp", ["mp1", "mp2"])
def test_tensor_parallel_replies_equal_peft(served, mp):
    root, folders, expected = served
    folders = {name: folders[name] for name in ("qkvo8", "all16rs")}
    got = run_ranks(_tp_replies, 2, str(root / mp), folders, timeout=180)[0]
    assert got == {f"{name}": expected[name][0] for name in [None, *folders]}


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_rows_on_three_adapters_and_the_base_get_their_own_bits_batched(served, quantize):
    """bfloat16 through the C layers, on a bfloat16 base and on one quantized at load (QLoRA's case): each
    row's tokens and log-probabilities alone equal those batched."""
    root, folders, _ = served
    engine = Engine.load(settings(root / "mp1", folders, dtype="bfloat16", prefix_caching=False, quantize=quantize))
    names = [None, "qkvo8", "all16", "all16rs"]
    batched = replies(engine, names, logprobs=2)
    alone = [replies(engine, [name], logprobs=2)[i] for name in names for i in range(len(PROMPTS))]
    for one, many in zip(alone, batched):
        assert (one.output, one.logprobs) == (many.output, many.logprobs), one.id


def test_a_prefix_cached_under_one_adapter_is_served_only_to_rows_of_the_same_weights(served):
    root, folders, _ = served
    # The same files under two names: the cache follows the weights' digest, not the name.
    engine = Engine.load(settings(root / "mp1", {**folders, "qkvo8-again": folders["qkvo8"]}))
    prompt = list(range(1, 50))  # three full blocks of 16 before its last token
    scheduler = engine.new_scheduler()

    def cached(name):
        seq = Sequence(f"{name}", prompt, SamplingParams(1), adapter=name)
        scheduler.add(seq)
        engine.run(scheduler)
        return seq.cached_tokens

    assert cached("qkvo8") == 0
    assert [cached(name) for name in (None, "all16", "qkvo8", "qkvo8-again")] == [0, 0, 48, 48]


def test_decode_steps_at_static_shapes_add_each_rows_adapter_in_one_batch(served, monkeypatch):
    """CUDA's path, run uncompiled on CPU (inductor's code is the next test's concern): steps padded to a bucket
    read each row's slot as an input and add its adapter's delta with no host-side grouping, rows of several
    adapters and the base in one step; replies still equal PEFT's."""
    monkeypatch.setenv("TP_LLAMA_MATMUL", "plain")  # PyTorch's matmuls, which the decode step compiles
    monkeypatch.setattr(torch, "compile", lambda forward, **_: forward)
    root, folders, expected = served
    engine = Engine.load(settings(root / "mp1", folders, compile="on", max_batch_size=4))
    assert engine.decode_step is not None and engine.decode_step.lora is not None
    assert engine.decode_step.sizes == (1, 2, 4)
    assert_replies_equal_peft(engine, expected, [None, "qkvo8", "all16rs"])


def test_compiled_decode_steps_take_each_rows_adapter_from_their_inputs(served, monkeypatch):
    """The same steps compiled: one graph serves rows on every adapter, their slot an input. One row a step, so
    one graph (a cold compile of each bucket takes most of a minute here)."""
    monkeypatch.setenv("TP_LLAMA_MATMUL", "plain")
    root, folders, expected = served
    engine = Engine.load(settings(root / "mp1", folders, compile="on", max_batch_size=1))
    assert engine.decode_step is not None and engine.decode_step.sizes == (1,)
    assert_replies_equal_peft(engine, expected, [None, "qkvo8", "all16rs"])


def _turns(ckpt: str, folders: dict, broken: str) -> list:
    """One slot (max_loras 1) for two adapters and a broken one, asked for in turn."""
    engine = Engine.load(settings(ckpt, folders, max_loras=1))
    engine.catalog["broken"] = broken
    out = []
    for name in ("qkvo8", "all16rs", "broken", "qkvo8"):
        try:
            out.append(replies(engine, [name])[0].output)
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_adapters_take_turns_in_fewer_slots_and_a_broken_one_fails_alone_at_tp_2(served, tmp_path):
    """The least recently used adapter leaves its slot for the next, written on both ranks in the same step; an
    adapter no rank can read fails that load only, and the ranks go on serving."""
    root, folders, expected = served
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((root / "qkvo8" / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not a tensor file")
    folders = {name: folders[name] for name in ("qkvo8", "all16rs")}
    got = run_ranks(_turns, 2, str(root / "mp1"), folders, str(broken), timeout=180)[0]
    assert got[:2] == [expected["qkvo8"][0], expected["all16rs"][0]] and got[3] == expected["qkvo8"][0]
    assert "broken" in got[2] and "adapter_model.safetensors" in got[2]


def test_an_adapter_unloaded_and_loaded_again_is_read_again(served, tmp_path):
    """What the handler does for unload_lora_adapter then load_lora_adapter of one name: the second load reads
    the folder's files as they are now, not the weights its slot kept; while requests still run on the old
    weights, the load is refused (retry)."""
    root, _, expected = served
    folder = tmp_path / "late"
    shutil.copytree(root / "qkvo8", folder)
    engine = Engine.load(settings(root / "mp1", {}, lora_runtime_loading=True, lora_folder=str(tmp_path)))
    engine.catalog["late"] = str(folder)
    engine.make_resident("late", set())
    assert [s.output for s in replies(engine, ["late"])] == expected["qkvo8"]
    del engine.catalog["late"]  # unloaded
    engine.lora.retire("late")
    shutil.rmtree(folder)
    shutil.copytree(root / "all16", folder)  # a new version of the adapter
    engine.catalog["late"] = str(folder)  # loaded again
    with pytest.raises(ValueError, match="requests still run on the unloaded LoRA adapter 'late'.*retry"):
        engine.make_resident("late", {"late"})
    engine.make_resident("late", set())
    assert [s.output for s in replies(engine, ["late"])] == expected["all16"]


def test_an_unknown_adapter_is_refused_with_the_known_names(served):
    root, folders, _ = served
    scheduler = Engine.load(settings(root / "mp1", {"qkvo8": folders["qkvo8"]})).new_scheduler()
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'nope'.*qkvo8"):
        scheduler.add(Sequence("x", PROMPTS[0], SamplingParams(1), adapter="nope"))
