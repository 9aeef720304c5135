"""params.json parsing: every key Meta ships, flat or nested, and clear errors naming the key."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tp_llama.errors import CheckpointError
from tp_llama.checkpoint.params import check_tokenizer_fits, read_params
from tp_llama.testing.tokenizer_train import build_tokenizer
from tp_llama.tokenizer import load_tokenizer

LLAMA2_7B = {"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32, "norm_eps": 1e-05, "vocab_size": -1}
LLAMA3_8B = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256,
             "multiple_of": 1024, "ffn_dim_multiplier": 1.3, "norm_eps": 1e-05, "rope_theta": 500000.0,
             "use_scaled_rope": True}
LLAMA2_70B = {"dim": 8192, "multiple_of": 4096, "ffn_dim_multiplier": 1.3, "n_heads": 64, "n_kv_heads": 8,
              "n_layers": 80, "norm_eps": 1e-05, "vocab_size": -1}


def write(tmp_path, params) -> str:
    (tmp_path / "params.json").write_text(json.dumps(params))
    return str(tmp_path)


def test_llama2_7b_takes_vocab_from_tokenizer(tmp_path):
    args = read_params(write(tmp_path, LLAMA2_7B), tokenizer_vocab=32000)
    assert (args.vocab_size, args.n_kv_heads, args.ffn_dim, args.family) == (32000, 32, 11008, "llama2")
    assert args.rope_theta == 10000.0 and not args.use_scaled_rope


def test_llama3_8b_published_sizes(tmp_path):
    args = read_params(write(tmp_path, {"model": LLAMA3_8B}), tokenizer_vocab=128256)
    assert (args.vocab_size, args.n_kv_heads, args.ffn_dim, args.family) == (128256, 8, 14336, "llama3")
    assert args.rope_theta == 500000.0 and args.use_scaled_rope


LLAMA32_1B = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256, "multiple_of": 256,
              "ffn_dim_multiplier": 1.5, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True}
LLAMA32_3B = {**LLAMA32_1B, "dim": 3072, "n_layers": 28, "n_heads": 24, "ffn_dim_multiplier": 1.0}


@pytest.mark.parametrize("params, factor", [(LLAMA32_1B, 32.0), (LLAMA32_3B, 32.0), (LLAMA3_8B, 8.0),
                                            ({**LLAMA32_1B, "rope_scaling_factor": 16}, 16.0)])
def test_scaled_rope_stretches_as_each_models_hugging_face_config_says(tmp_path, params, factor):
    """Llama 3.2 1B and 3B stretch RoPE by 32 (their config.json's rope_scaling; Meta's params.json says nothing
    and llama-models uses 3.1's 8): the frequencies equal transformers' llama3 RoPE under that config."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tp_llama.model.llama import rope_frequencies

    args = read_params(write(tmp_path, params), tokenizer_vocab=128256)
    assert args.rope_scaling == (factor, 4.0)
    config = LlamaConfig(hidden_size=args.dim, num_attention_heads=args.n_heads, rope_parameters={
        "rope_type": "llama3", "rope_theta": args.rope_theta, "factor": factor, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = rope_frequencies(args.head_dim, args.rope_theta, True, args.rope_scaling)
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=0)


def test_llama2_70b_ffn_width(tmp_path):
    assert read_params(write(tmp_path, LLAMA2_70B), tokenizer_vocab=32000).ffn_dim == 28672


@pytest.mark.parametrize("key,value,message", [
    ("n_heads", "32", "key 'n_heads' has invalid value"),
    ("dim", True, "key 'dim' has invalid value"),
    ("n_kv_heads", 3, "not divisible by n_kv_heads"),
    ("norm_eps", -1.0, "'norm_eps' must be positive"),
    ("ffn_dim_multiplier", "1.3", "key 'ffn_dim_multiplier' has invalid value"),
    ("use_scaled_rope", 1, "key 'use_scaled_rope' has invalid value"),
    ("n_layers", 0, "'n_layers' must be positive"),
    ("n_kv_heads", 0, "'n_kv_heads' must be positive"),
])
def test_bad_values_name_the_key(tmp_path, key, value, message):
    with pytest.raises(CheckpointError, match=message):
        read_params(write(tmp_path, {**LLAMA2_7B, key: value}), tokenizer_vocab=32000)


def test_missing_key_and_bad_json(tmp_path):
    params = dict(LLAMA2_7B)
    del params["n_layers"]
    with pytest.raises(CheckpointError, match="missing required key 'n_layers'"):
        read_params(write(tmp_path, params), tokenizer_vocab=32000)
    (tmp_path / "params.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="params.json: not valid JSON"):
        read_params(str(tmp_path), tokenizer_vocab=32000)


def test_the_device_follows_the_yaml_and_one_gpu_per_rank():
    """deviceType decides (cpu stays on CPU with GPUs present); more ranks than GPUs is refused with
    what to change, before any collective. GPU counts are faked: the choice is the same anywhere."""
    from tp_llama.parallel.distributed import pick_device
    from tp_llama.serving.settings import device_of

    assert pick_device(device_of("cpu"), 1, 2, gpus=8) == torch.device("cpu")
    assert pick_device(device_of(None), 1, 2, gpus=0) == torch.device("cpu")
    assert pick_device(device_of(None), 1, 2, gpus=2) == torch.device("cuda", 1)
    assert pick_device(device_of("gpu"), 3, 4, gpus=4) == torch.device("cuda", 3)
    with pytest.raises(RuntimeError, match=r"4 ranks on this node but 2 GPU\(s\) visible.*nproc-per-node to at most 2"):
        pick_device("cuda", 0, 4, gpus=2)
    with pytest.raises(RuntimeError, match="sees none"):
        pick_device("cuda", 0, 1, gpus=0)
    with pytest.raises(ValueError, match="deviceType must be one of"):
        device_of("tpu")


@pytest.mark.parametrize("family", ["llama2", "llama3"])
def test_a_tokenizer_must_fit_the_embedding(tmp_path, family):
    """Ids past vocab_size have no embedding row: refused naming both files and the counts; fewer ids
    than rows (an embedding padded, as some of Meta's are) or exactly as many pass."""
    build_tokenizer(family, tmp_path / "tokenizer.model", 512)
    tokenizer = load_tokenizer(tmp_path / "tokenizer.model")
    args = read_params(write(tmp_path, LLAMA3_8B | {"vocab_size": 512}))
    check_tokenizer_fits(tokenizer, args, tmp_path)
    check_tokenizer_fits(tokenizer, dataclasses.replace(args, vocab_size=600), tmp_path)
    short = dataclasses.replace(args, vocab_size=500)
    with pytest.raises(CheckpointError) as info:
        check_tokenizer_fits(tokenizer, short, tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'tokenizer.model'}: the tokenizer makes 512 ids ({family} format)")
    assert f"{tmp_path / 'params.json'} has vocab_size 500" in message and "ids 500 to 511 have no row" in message
    # Llama 3's reserved specials sit at the end; SentencePiece's BOS/EOS at 1 and 2, inside.
    assert ("12 of its special ids among them: <|reserved_special_token_" in message) == (family == "llama3")
    assert ("none of them special" in message) == (family == "llama2")
