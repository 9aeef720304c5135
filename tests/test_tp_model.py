"""localize: the DTensor model after loading, turned into plain local shards, computes the same logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from dist_util import run_ranks
from tp_llama.layout import full_shapes, shard_dim
from tp_llama.model import Transformer
from tp_llama.parallel import LocalEmbedding, LocalLinear, apply_tensor_parallel, localize, make_mesh
from tp_llama.params import ModelArgs

ARGS = {
    "llama2": ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=96, family="llama2"),
    "llama3": ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=96, family="llama3",
                        rope_theta=500000.0, use_scaled_rope=True),
}
# Each rank's expected collective per module (wq/wk/wv/w1/w3 need none).
COMM = {
    "llama2": {"tok_embeddings": "all_gather", "output": "all_gather", "wo": "all_reduce", "w2": "all_reduce"},
    "llama3": {"tok_embeddings": "all_reduce", "output": "all_gather", "wo": "all_reduce", "w2": "all_reduce"},
}


def full_weights(args: ModelArgs) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {k: torch.randn(shape, generator=gen) / shape[-1] ** 0.5 for k, shape in full_shapes(args).items()}


def forward_twice(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a 2-row prefill (every position), then of one decode step (last position only)."""
    with torch.inference_mode():
        prefill = model(tokens, torch.zeros(2, dtype=torch.long), slice(0, 2), last_only=False)
        decode = model(tokens[:, :1], torch.full((2,), tokens.shape[1]), slice(0, 2))
    return prefill, decode


def localized_matches_dtensor_and_whole(family: str) -> str:
    args, rank, tp = ARGS[family], dist.get_rank(), dist.get_world_size()
    weights = full_weights(args)
    # Ids from every rank's vocabulary range, so the vocab-parallel lookup masks and sums.
    tokens = torch.tensor([[1, 40, 63, 7, 33], [62, 0, 31, 32, 5]])

    whole = Transformer(args)
    whole.load_state_dict(weights)
    whole.setup_caches(2, 16, torch.float32, torch.device("cpu"))
    want_prefill, want_decode = forward_twice(whole, tokens)

    mesh = make_mesh(torch.device("cpu"), tp)
    with torch.device("meta"):
        model = Transformer(args)
    apply_tensor_parallel(model, mesh)
    state = {}
    for key, tensor in weights.items():
        dim = shard_dim(key, family)
        state[key] = tensor if dim is None else DTensor.from_local(tensor.chunk(tp, dim)[rank].clone(), mesh, [Shard(dim)])
    model.load_state_dict(state, strict=True, assign=True)
    model.setup_caches(2, 16, torch.float32, torch.device("cpu"), tp)
    dtensor_prefill, dtensor_decode = forward_twice(model, tokens)

    assert localize(model) is model
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    for key, param in model.state_dict().items():
        assert not isinstance(param, DTensor), key
        dim = shard_dim(key, family)
        assert torch.equal(param, weights[key] if dim is None else weights[key].chunk(tp, dim)[rank]), key
    assert list(model.state_dict()) == list(weights)
    comms = {name.rpartition(".")[2]: m.comm for name, m in model.named_modules()
             if isinstance(m, (LocalLinear, LocalEmbedding))}
    assert comms == {**dict.fromkeys(["wq", "wk", "wv", "w1", "w3"], "none"), **COMM[family]}
    model.setup_caches(2, 16, torch.float32, torch.device("cpu"), tp)
    got_prefill, got_decode = forward_twice(model, tokens)

    assert got_prefill.shape == (2, 5, args.vocab_size) and got_decode.shape == (2, args.vocab_size)
    torch.testing.assert_close(got_prefill, dtensor_prefill, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_decode, dtensor_decode, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_prefill, want_prefill, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_decode, want_decode, rtol=0, atol=1e-5)
    return "ok"


@pytest.mark.parametrize("family", ["llama2", "llama3"])
def test_localized_model_matches_dtensor_model_and_whole_model(family):
    assert run_ranks(localized_matches_dtensor_and_whole, 2, family, timeout=120) == ["ok", "ok"]


def test_a_model_without_dtensors_is_left_alone():
    model = Transformer(ARGS["llama3"])
    before = dict(model.named_modules())
    assert localize(model) is model
    assert dict(model.named_modules()) == before
