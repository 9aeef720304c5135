"""Self-check of the Llama 4 oracle's writer (tests.support.meta_llama4): its files hold Meta's download
key names with fairscale's per-shard shapes, written out here from the hooks' side. That Meta's own model
loads them strictly and gives informative logits is checked where the oracle runs (tests/test_llama4.py):
a Meta run costs a spawn of its ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.meta_llama4 import MOE_STAT_SUFFIXES, ffn_widths, is_moe_layer, small_params, write_llama4_checkpoint

pytest.importorskip("llama_models.llama4.model", reason="llama-models 0.3.0 is Meta's reference")
pytest.importorskip("fairscale", reason="Meta's Llama 4 runs on fairscale's model-parallel layers")

PARAMS = small_params()


def expected_shapes(params: dict, mp: int) -> dict[str, tuple[int, ...]]:
    """Meta's download names and one shard's shapes, written out from the hooks' side."""
    d, v, e = params["dim"], params["vocab_size"], params["moe_args"]["num_experts"]
    hd = d // params["n_heads"]
    q, kv = params["n_heads"] * hd // mp, params["n_kv_heads"] * hd // mp
    dense, moe = (f // mp for f in ffn_widths(params))
    shapes = {"tok_embeddings.weight": (v // mp, d), "norm.weight": (d,), "output.weight": (v // mp, d)}
    for n in range(params["n_layers"]):
        p = f"layers.{n}."
        shapes |= {p + "attention.wqkv.weight": (q + 2 * kv, d), p + "attention.wo.weight": (d, q),
                   p + "attention.wqkv.layer_norm_weight": (d,)}
        if is_moe_layer(params, n):
            f = p + "feed_forward."
            shapes |= {f + "norm.weight": (d,), f + "router_DE": (d, e), f + "w_in_shared_FD.weight": (moe, d),
                       f + "w_swiglu_FD.weight": (moe, d), f + "w_out_shared_DF.weight": (d, moe),
                       f + "experts.moe_w_in_eD_F": (e * d, moe), f + "experts.moe_w_swiglu_eD_F": (e * d, moe),
                       f + "experts.moe_w_out_eF_D": (e * moe, d)}
        else:
            shapes |= {p + "feed_forward.mlp.fc1_weight": (2 * dense, d), p + "feed_forward.mlp.fc2_weight": (d, dense),
                       p + "feed_forward.mlp.layer_norm_weight": (d,)}
    return shapes


def load(path: Path) -> dict:
    import io

    with torch.serialization.safe_globals([io.BytesIO]):
        return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama4")
    write_llama4_checkpoint(root / "mp1", PARAMS, 1, seed=3)
    write_llama4_checkpoint(root / "mp2", PARAMS, 2, seed=3, extra_entries=True)
    return {"mp1": root / "mp1", "mp2": root / "mp2"}


def test_files_hold_meta_download_names_and_shard_shapes(folders):
    plain = load(folders["mp1"] / "consolidated.00.pth")
    assert {k: tuple(t.shape) for k, t in plain.items()} == expected_shapes(PARAMS, 1)
    assert not (folders["mp1"] / "tokenizer.model").exists()  # a 256-id vocabulary has no tokenizer
    shards = [load(folders["mp2"] / f"consolidated.{r:02d}.pth") for r in range(2)]
    want = expected_shapes(PARAMS, 2)
    for shard in shards:
        tensors = {k: tuple(v.shape) for k, v in shard.items() if k in want}
        assert tensors == want
        extra = set(shard) - set(want)
        assert "rope.freqs" in extra and "layers.0.attention.wqkv._extra_state" in extra
        assert all(k == "rope.freqs" or k.endswith(("_extra_state",) + MOE_STAT_SUFFIXES) for k in extra)
        assert all(shard[k].dtype == torch.bfloat16 for k in want)
    # Replicated keys are equal in both shards; split ones are halves of the MP-1 tensor.
    assert torch.equal(shards[0]["layers.1.feed_forward.router_DE"], shards[1]["layers.1.feed_forward.router_DE"])
    assert torch.equal(torch.cat([s["output.weight"] for s in shards]), plain["output.weight"])
    assert torch.equal(torch.cat([s["layers.0.attention.wo.weight"] for s in shards], 1),
                       plain["layers.0.attention.wo.weight"])

