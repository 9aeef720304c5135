"""LoRA adapters read from PEFT's and torchtune's files (tp_llama/lora/adapters.py), checked against PEFT's own
merge on transformers' LlamaForCausalLM: W_meta + B @ A, in Hugging Face's order, is PEFT's merged weight."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.lib.hf_convert import meta_to_hf
from tests.support.peft_reference import hf_model, merged, save_peft, write_base, write_torchtune
from tp_llama.lora.adapters import MODULES, AdapterError, read_adapter

MAX_RANK = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
META_KEYS = {"wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo",
             "w1": "feed_forward.w1", "w2": "feed_forward.w2", "w3": "feed_forward.w3"}
PEFT_LAYER = "base_model.model.model.layers."

# LoraConfig's arguments, the adapter's largest rank and how many (layer, module) pairs it adapts.
CASES = {
    "qkvo r8": ({"r": 8, "lora_alpha": 16, "target_modules": QKVO}, 8, 8),
    "all r16 rslora": ({"r": 16, "lora_alpha": 8, "use_rslora": True, "target_modules": ALL}, 16, 14),
    "all-linear r8 alpha 12": ({"r": 8, "lora_alpha": 12, "target_modules": "all-linear"}, 8, 14),
    "patterns": ({"r": 8, "lora_alpha": 16, "target_modules": ALL,
                  "rank_pattern": {"q_proj": 16, "layers.1.mlp.down_proj": 4},
                  "alpha_pattern": {"v_proj": 5, r"model\.layers\.0\.self_attn\.o_proj": 64}}, 16, 14),
    "patterns rslora": ({"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": ALL,
                         "rank_pattern": {"k_proj": 4, "up_proj": 16}, "alpha_pattern": {"gate_proj": 3}}, 16, 14),
    "layers_to_transform": ({"r": 16, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "down_proj"],
                             "layers_to_transform": [1]}, 16, 3),
    "regex targets": ({"r": 8, "lora_alpha": 20, "target_modules": r".*\.(k_proj|up_proj)"}, 8, 4),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory):
    return write_base(tmp_path_factory.mktemp("base"))


def fine_tuned(state: dict[str, torch.Tensor], weights: dict) -> dict[str, torch.Tensor]:
    """The Meta checkpoint with each adapted module's W + B @ A."""
    state = dict(state)
    for (layer, module), (a, b) in weights.items():
        key = f"layers.{layer}.{META_KEYS[module]}.weight"
        state[key] = state[key] + b @ a
    return state


@pytest.mark.parametrize("case", CASES)
def test_matches_peft_merge(case: str, base, tmp_path: Path) -> None:
    args, state = base
    lora, rank, n_modules = CASES[case]
    model = save_peft(state, args, tmp_path / "adapter", seed=list(CASES).index(case), **lora)
    adapter = read_adapter("tuned", tmp_path / "adapter", args, MAX_RANK)
    assert (adapter.name, adapter.rank, len(adapter.weights)) == ("tuned", rank, n_modules)
    assert adapter.source == str(tmp_path / "adapter" / "adapter_model.safetensors")
    for (layer, module), (a, b) in adapter.weights.items():
        assert module in MODULES and 0 <= layer < args.n_layers
        assert a.dtype == b.dtype == torch.float32 and a.shape[0] == b.shape[1]
    reference, unadapted = merged(model), meta_to_hf(state, args)
    ours = meta_to_hf(fine_tuned(state, adapter.weights), args)
    assert reference.keys() == ours.keys()
    for key, want in reference.items():
        torch.testing.assert_close(ours[key], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: {key}: {m}")
    # The adapter moves the weights far beyond the tolerance, so a wrong scale or row order cannot pass.
    assert max((reference[k] - unadapted[k]).abs().max().item() for k in reference) > 0.05


def test_torchtune_layout_reads_the_same(base, tmp_path: Path) -> None:
    args, state = base
    save_peft(state, args, tmp_path / "peft", seed=3, r=16, lora_alpha=24, target_modules=ALL)
    peft = read_adapter("a", tmp_path / "peft", args, MAX_RANK)
    tune_dir = write_torchtune(tmp_path / "peft", tmp_path / "tune", args)
    entries = [{"path": str(tune_dir), "lora_alpha": 24}, {"path": tune_dir, "lora_alpha": 24.0, "format": "torchtune"}]
    epoch_dir = write_torchtune(tmp_path / "peft", tmp_path / "epoch", args, name="adapter_0.pt")
    for entry in [*entries, {"path": epoch_dir, "lora_alpha": 24}]:
        tune = read_adapter("b", entry, args, MAX_RANK)
        assert tune.weights.keys() == peft.weights.keys()
        for key, (a, b) in peft.weights.items():
            assert torch.equal(tune.weights[key][0], a) and torch.equal(tune.weights[key][1], b), key
        assert (tune.digest, tune.rank) == (peft.digest, peft.rank)
        assert Path(tune.source).parent == Path(entry["path"])


def test_digest_follows_weights_only(base, tmp_path: Path) -> None:
    args, state = base
    save_peft(state, args, tmp_path / "one", seed=5, r=8, lora_alpha=16, target_modules=QKVO)
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    first, copy = read_adapter("one", tmp_path / "one", args, MAX_RANK), read_adapter("two", tmp_path / "two", args, 8)
    assert len(first.digest) == 64 and first.digest == copy.digest and first.source != copy.source
    tensors = load_file(tmp_path / "two" / "adapter_model.safetensors")
    tensors[PEFT_LAYER + "1.self_attn.o_proj.lora_B.weight"][3, 2] += 1e-3
    save_file(tensors, tmp_path / "two" / "adapter_model.safetensors")
    assert read_adapter("one", tmp_path / "two", args, MAX_RANK).digest != first.digest
    assert read_adapter("one", {"path": tmp_path / "one", "format": "peft"}, args, MAX_RANK).digest == first.digest


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_adapter_on_a_base_peft_changed_is_refused_until_converted(init: str, base, tmp_path: Path) -> None:
    """PiSSA and OLoRA take their first B @ A out of the base weights: PEFT's merge of such an adapter, saved as
    trained, is W - B0 @ A0 + B @ A, which W + B @ A cannot serve; once PEFT converts it, it is plain LoRA."""
    from peft import LoraConfig, PeftModel, get_peft_model

    args, state = base
    torch.manual_seed(7)
    model = get_peft_model(hf_model(state, args), LoraConfig(r=8, lora_alpha=16, target_modules=QKVO,
                                                             init_lora_weights=init))
    model.save_pretrained(tmp_path / "initial")  # before training: what PEFT's conversion subtracts
    with torch.no_grad():  # a step of training
        for name, factor in model.named_parameters():
            if "lora_" in name:
                factor.add_(0.1 * torch.randn_like(factor))
    model.save_pretrained(tmp_path / "trained")
    with pytest.raises(AdapterError, match=rf"trained/adapter_config.json: init_lora_weights '{init}'.*"
                                           "path_initial_model_for_weight_conversion"):
        read_adapter("trained", tmp_path / "trained", args, MAX_RANK)
    model.save_pretrained(tmp_path / "converted", path_initial_model_for_weight_conversion=str(tmp_path / "initial"))
    adapter = read_adapter("converted", tmp_path / "converted", args, MAX_RANK)
    reference = merged(PeftModel.from_pretrained(hf_model(state, args), tmp_path / "trained"))
    ours, unadapted = meta_to_hf(fine_tuned(state, adapter.weights), args), meta_to_hf(state, args)
    for key, want in reference.items():
        torch.testing.assert_close(ours[key], want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{init}: {key}: {m}")
    assert max((reference[k] - unadapted[k]).abs().max().item() for k in reference) > 0.05


# ---- refusals: each case makes a bad adapter from a good one and names words its message must hold


def edit_config(folder: Path, **changes) -> Path:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def edit_tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> Path:
    """Rewrite the folder's PEFT or torchtune tensors after edit(tensors)."""
    path = folder / "adapter_model.safetensors"
    if path.is_file():
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, path)
    else:
        tensors = torch.load(folder / "adapter_model.pt", weights_only=True)
        edit(tensors)
        torch.save(tensors, folder / "adapter_model.pt")
    return folder


def spoil(path: Path, data: bytes | None) -> Path:
    """path's bytes replaced by data (None: path removed); returns its folder."""
    if data is None:
        path.unlink()
    else:
        path.write_bytes(data)
    return path.parent


def peft_variant(base, folder: Path, edit: Callable[[Path], object] = lambda folder: None, **lora) -> Path:
    """A real PEFT adapter of another config in folder, then edit(folder)."""
    shutil.rmtree(folder)
    save_peft(base[1], base[0], folder, **{"r": 8, "lora_alpha": 16, "target_modules": ALL, **lora})
    edit(folder)
    return folder


def emptied(folder: Path) -> Path:
    for path in folder.iterdir():
        path.unlink()
    return folder


def dropped(key: str) -> Callable[[dict], None]:
    return lambda tensors: tensors.pop(key)


def renamed(old: str, new: str) -> Callable[[dict], None]:
    return lambda tensors: tensors.__setitem__(new, tensors.pop(old))


def added(key: str, shape: tuple[int, ...]) -> Callable[[dict], None]:
    return lambda tensors: tensors.__setitem__(key, torch.ones(shape))


def several_epochs(tune: Path) -> dict:
    """torchtune's older per-epoch names, twice over, and no adapter_model.pt."""
    shutil.copy(tune / "adapter_model.pt", tune / "adapter_1.pt")
    shutil.move(tune / "adapter_model.pt", tune / "adapter_0.pt")
    return {"path": tune, "lora_alpha": 8}


# name -> (make a bad adapter from (base, a good PEFT folder, its torchtune layout): the entry to read;
# read_adapter's max_rank or ModelArgs fields to change; words its message must hold)
REFUSALS = {
    "DoRA config": (lambda base, p, t: peft_variant(base, p, use_dora=True), {},
                    ["DoRA", "adapter_config.json", "use_dora", "q_proj"]),
    "DoRA tensors": (lambda base, p, t: peft_variant(base, p, lambda f: edit_config(f, use_dora=False), use_dora=True),
                     {}, ["DoRA", "adapter_model.safetensors", "lora_magnitude_vector", "layers.0.mlp.down_proj"]),
    "bias config": (lambda base, p, t: edit_config(p, bias="lora_only"), {},
                    ["trained biases", "adapter_config.json", "lora_only", "gate_proj"]),
    "lora_bias config": (lambda base, p, t: peft_variant(base, p, lora_bias=True), {},
                         ["trained biases", "adapter_config.json", "lora_bias", "up_proj"]),
    "bias tensor": (lambda base, p, t: peft_variant(base, p, lambda f: edit_config(f, lora_bias=False),
                                                    lora_bias=True), {},
                    ["trained biases", "adapter_model.safetensors", "layers.0.mlp.down_proj.lora_B.bias"]),
    "modules_to_save": (lambda base, p, t: peft_variant(base, p, target_modules=QKVO, modules_to_save=["lm_head"]), {},
                        ["modules_to_save", "adapter_config.json", "lm_head"]),
    "embeddings config": (lambda base, p, t: peft_variant(base, p, target_modules=["q_proj", "embed_tokens"]), {},
                          ["embeddings", "adapter_config.json", "embed_tokens"]),
    # PEFT saves the embeddings' base weight beside the factors; without it the factors alone are refused
    "embeddings tensor": (lambda base, p, t: peft_variant(base, p, lambda f: edit_tensors(
        edit_config(f, target_modules=["q_proj"]), dropped("base_model.model.model.embed_tokens.base_layer.weight")),
        target_modules=["embed_tokens", "q_proj"]),
                          {}, ["embeddings", "adapter_model.safetensors", "model.embed_tokens.lora_embedding_A"]),
    "output layer tensor": (lambda base, p, t: peft_variant(base, p, lambda f: edit_tensors(
        edit_config(f, target_modules=QKVO), dropped("base_model.model.lm_head.base_layer.weight")),
        target_modules=["lm_head", *QKVO]),
                            {}, ["output layer", "adapter_model.safetensors", "lm_head.lora_A.weight"]),
    "rank above max": (lambda base, p, t: p, {"max_rank": 4},
                       ["handler.max_lora_rank", "rank 8", "adapter_model.safetensors", "layers.0.mlp.gate_proj"]),
    "other base width": (lambda base, p, t: p, {"ffn_dim": 256},
                         ["another base", "adapter_model.safetensors", "layers.0.mlp.gate_proj (w1)", "192 x 64"]),
    "other base depth": (lambda base, p, t: p, {"n_layers": 1},
                         ["another base", "adapter_model.safetensors", "model.layers.1.", "layer 1", "1 layers"]),
    "unknown target": (lambda base, p, t: edit_config(p, target_modules=["q_proj", "qkv_proj"]), {},
                       ["unknown target module", "adapter_config.json", "qkv_proj"]),
    "unknown tensor": (lambda base, p, t: edit_tensors(p, renamed(PEFT_LAYER + "1.self_attn.q_proj.lora_A.weight",
                                                                  PEFT_LAYER + "1.self_attn.qkv_proj.lora_A.weight")),
                       {}, ["not a LoRA factor", "adapter_model.safetensors", "layers.1.self_attn.qkv_proj"]),
    "missing lora_B": (lambda base, p, t: edit_tensors(p, dropped(PEFT_LAYER + "0.self_attn.k_proj.lora_B.weight")),
                       {}, ["no lora_B", "adapter_model.safetensors", "layers.0.self_attn.k_proj"]),
    "rank disagrees": (lambda base, p, t: edit_config(p, rank_pattern={"o_proj": 4}), {},
                       ["rank 8", "rank 4", "disagree", "adapter_model.safetensors", "layers.0.self_attn.o_proj"]),
    "other PEFT type": (lambda base, p, t: edit_config(p, peft_type="IA3"), {},
                        ["IA3", "adapter_config.json", "v_proj"]),
    "empty folder": (lambda base, p, t: emptied(p), {},
                     ["no adapter found", "peft", "adapter_config.json", "adapter_model.safetensors",
                      "adapter_model.pt"]),
    "no weights file": (lambda base, p, t: spoil(p / "adapter_model.safetensors", None), {},
                        ["no weights", "peft", "adapter_model.safetensors", "adapter_model.bin"]),
    "corrupt weights": (lambda base, p, t: spoil(p / "adapter_model.safetensors",
                                                 (p / "adapter_model.safetensors").read_bytes()[:500]), {},
                        ["corrupt", "adapter_model.safetensors"]),
    "corrupt config": (lambda base, p, t: spoil(p / "adapter_config.json", b"{r: 8"), {},
                       ["unreadable", "adapter_config.json"]),
    "lora_alpha for PEFT": (lambda base, p, t: {"path": p, "lora_alpha": 16}, {},
                            ["lora_alpha", "adapter_config.json", "drop it"]),
    "bad format": (lambda base, p, t: {"path": p, "format": "gguf"}, {}, ["format 'gguf'", "peft", "torchtune"]),
    "torchtune without alpha": (lambda base, p, t: t, {}, ["set lora_alpha", "adapter_model.pt"]),
    "torchtune DoRA": (lambda base, p, t: {"path": edit_tensors(t, added("layers.1.attn.v_proj.magnitude", (32,))),
                                           "lora_alpha": 8}, {}, ["DoRA", "adapter_model.pt", "layers.1.attn.v_proj"]),
    "torchtune output": (lambda base, p, t: {"path": edit_tensors(t, added("output.lora_a.weight", (8, 64))),
                                             "lora_alpha": 8}, {},
                         ["output layer", "adapter_model.pt", "output.lora_a"]),
    "torchtune corrupt": (lambda base, p, t: {"path": spoil(t / "adapter_model.pt", b"not a pickle"), "lora_alpha": 8},
                          {}, ["corrupt", "adapter_model.pt"]),
    "torchtune several": (lambda base, p, t: several_epochs(t), {}, ["several", "adapter_0.pt", "adapter_1.pt"]),
}


@pytest.fixture(scope="module")
def good(base, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One good PEFT adapter and its torchtune layout, copied and spoiled by each refusal."""
    root = tmp_path_factory.mktemp("good")
    save_peft(base[1], base[0], root / "peft", r=8, lora_alpha=16, target_modules=ALL)
    write_torchtune(root / "peft", root / "tune", base[0])
    return root


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals(case: str, base, good: Path, tmp_path: Path) -> None:
    make, overrides, words = REFUSALS[case]
    shutil.copytree(good / "peft", tmp_path / "peft")
    shutil.copytree(good / "tune", tmp_path / "tune")
    entry = make(base, tmp_path / "peft", tmp_path / "tune")
    args = dataclasses.replace(base[0], **{k: v for k, v in overrides.items() if k != "max_rank"})
    with pytest.raises(AdapterError) as refused:
        read_adapter("bad", entry, args, overrides.get("max_rank", MAX_RANK))
    message = str(refused.value)
    assert message.startswith("LoRA adapter 'bad': ") and "tensor(" not in message, message
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
