"""The seed converter API on its own: gloo ranks, FSDP loads its output, full weights come back exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from tests.support.dist_util import run_ranks
from tests.support.reference import split_dim
from tp_llama.checkpoint_converter import (
    _all_gather_into_list,
    _is_tp_sharded,
    _verify_fqn_across_ranks,
    build_distributed_state_dict_from_consolidated,
)
from tp_llama.errors import CheckpointError
from tp_llama.model import Transformer
from tp_llama.model import ModelArgs

ARGS = {
    "llama2": ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=96, family="llama2"),
    "llama3": ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=64, ffn_dim=96, family="llama3"),
}


def full_weights(family: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    model = Transformer(ARGS[family])
    return {k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def consolidated_for(family: str, mp: int, mp_rank: int) -> dict[str, torch.Tensor]:
    shard = {}
    for key, tensor in full_weights(family).items():
        dim = split_dim(key, family)
        shard[key] = tensor.clone() if dim is None else tensor.chunk(mp, dim=dim)[mp_rank].clone()
    shard["rope.freqs"] = torch.arange(4.0)
    return shard


def convert_load_and_unshard(family: str, mp: int, use_dtensor: bool, offload: bool) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Transformer(ARGS[family])
    consolidated = consolidated_for(family, mp, rank % mp)
    state = build_distributed_state_dict_from_consolidated(
        model, consolidated, mp, offload_to_cpu=offload, use_dtensor=use_dtensor
    )
    assert torch.equal(state.pop("rope.freqs"), consolidated["rope.freqs"])
    kind = DTensor if use_dtensor else ShardedTensor
    assert all(isinstance(v, kind) for v in state.values()), {k: type(v) for k, v in state.items()}
    local = state["layers.0.attention.wq.weight"]
    local_tensor = local.to_local() if use_dtensor else local.local_tensor()
    assert local_tensor.device.type == "cpu"
    assert local_tensor.shape[0] == ARGS[family].dim // world  # FSDP chunk of the full tensor

    mesh = init_device_mesh("cpu", (world,)) if use_dtensor else None
    wrapped = FSDP(model, device_mesh=mesh, device_id=torch.device("cpu"), use_orig_params=True)
    with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
        wrapped.load_state_dict(state)
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, config):
        back = wrapped.state_dict()
    expected = full_weights(family)
    assert back.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(back[key], tensor), key
    return "ok"


def convert_every_layout() -> list[str]:
    done = []
    world = dist.get_world_size()
    for family in ARGS:
        for mp in (m for m in (1, 2, 4) if world % m == 0):
            for use_dtensor in (False, True):
                convert_load_and_unshard(family, mp, use_dtensor, offload=(mp == 2))
                done.append(f"{family}/mp{mp}/{'dtensor' if use_dtensor else 'sharded'}")
    return done


def _helpers_then_every_layout() -> dict:
    """On 2 ranks, one group for both tests of it (spawned ranks cost a torch import each): the helpers'
    checks, then every layout; each part's result, or its traceback."""
    import traceback

    out = {}
    for name, part in (("helpers", helper_checks), ("converted", convert_every_layout)):
        try:
            out[name] = part()
        except Exception:  # noqa: BLE001 - reported by the part's own test
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_helpers_then_every_layout, 2, timeout=240)


@pytest.mark.parametrize("world_size", [2, 4])
def test_converted_state_dict_loads_into_fsdp_exactly(world_size, request):
    if world_size == 2:
        done = [result["converted"] for result in request.getfixturevalue("two_ranks")]
        assert all(isinstance(d, list) for d in done), "\n".join(map(str, done))
    else:
        done = run_ranks(convert_every_layout, world_size, timeout=240)
    expected_cases = 2 * 2 * len([m for m in (1, 2, 4) if world_size % m == 0])
    assert all(len(d) == expected_cases for d in done)


def helper_checks() -> dict:
    rank = dist.get_rank()
    gathered = _all_gather_into_list(torch.full((2, 3), float(rank)), dist.group.WORLD)
    gathered_ok = [int(t[0, 0]) for t in gathered] == [0, 1] and all(t.device.type == "cpu" for t in gathered)
    group = dist.new_group(backend="gloo")
    _verify_fqn_across_ranks("layers.0.attention.wq.weight", group)
    try:
        _verify_fqn_across_ranks(f"layers.{rank}.attention.wq.weight", group)
        mismatch = "not raised"
    except AssertionError as exc:
        mismatch = str(exc)
    try:
        build_distributed_state_dict_from_consolidated(Transformer(ARGS["llama2"]), {}, 4)
        bad_world = "not raised"
    except ValueError as exc:
        bad_world = str(exc)
    # Only rank 1 holds a broken shard: every rank must fail, and nobody may hang in a collective.
    consolidated = consolidated_for("llama2", 2, rank)
    if rank == 1:
        consolidated["layers.1.feed_forward.w2.weight"] = consolidated["layers.1.feed_forward.w2.weight"][:, :5]
    try:
        build_distributed_state_dict_from_consolidated(Transformer(ARGS["llama2"]), consolidated, 2)
        bad_shard = "not raised"
    except CheckpointError as exc:
        bad_shard = str(exc)
    # The seed passes on every `rope.freqs` entry: Llama 2's at the top, the original LLaMA's one per layer.
    consolidated = consolidated_for("llama2", 2, rank)
    consolidated["layers.0.attention.inner_attention.rope.freqs"] = torch.arange(4.0)
    try:
        state = build_distributed_state_dict_from_consolidated(Transformer(ARGS["llama2"]), consolidated, 2)
        layer_freqs = torch.equal(state["layers.0.attention.inner_attention.rope.freqs"], torch.arange(4.0))
    except CheckpointError as exc:
        layer_freqs = str(exc)
    return {"gathered_ok": gathered_ok, "mismatch": mismatch, "bad_world": bad_world, "bad_shard": bad_shard,
            "layer_freqs": layer_freqs, "any_order": _shards_listed_in_another_order()}


def _shards_listed_in_another_order() -> list[str] | str:
    """Rank 1's dict lists its tensors backwards: the converter must still pair each tensor with its own halves.
    The names whose full tensor differs from the unsharded weights (none expected), or the error."""
    consolidated = consolidated_for("llama3", 2, dist.get_rank())
    if dist.get_rank() == 1:
        consolidated = dict(reversed(consolidated.items()))
    try:
        state = build_distributed_state_dict_from_consolidated(
            Transformer(ARGS["llama3"]), consolidated, 2, use_dtensor=True)
    except AssertionError as exc:
        return str(exc)
    return [k for k, v in full_weights("llama3").items() if not torch.equal(state[k].full_tensor(), v)]


def test_helpers_gather_verify_fail_together_and_pass_rope_tables(two_ranks):
    for result in (ranks["helpers"] for ranks in two_ranks):
        assert isinstance(result, dict), result
        assert result["gathered_ok"]
        assert "different parameters" in result["mismatch"]
        assert "not a multiple" in result["bad_world"]
        assert "layers.1.feed_forward.w2.weight" in result["bad_shard"] and "rank 1" in result["bad_shard"]
        assert result["layer_freqs"] is True, result["layer_freqs"]


def test_ranks_may_list_their_tensors_in_different_orders(two_ranks):
    for result in (ranks["helpers"] for ranks in two_ranks):
        assert isinstance(result, dict), result
        assert result["any_order"] == [], result["any_order"]


def _one_rank_loads_into_fsdp() -> str:
    """World size 1: FSDP runs NO_SHARD, which loads whole plain tensors; the converter's output must load."""
    for use_dtensor in (False, True):
        model = Transformer(ARGS["llama2"])
        state = build_distributed_state_dict_from_consolidated(
            model, consolidated_for("llama2", 1, 0), 1, use_dtensor=use_dtensor)
        state.pop("rope.freqs")
        mesh = init_device_mesh("cpu", (1,)) if use_dtensor else None
        wrapped = FSDP(model, device_mesh=mesh, device_id=torch.device("cpu"), use_orig_params=True)
        with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
            wrapped.load_state_dict(state)
        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
            back = wrapped.state_dict()
        for key, tensor in full_weights("llama2").items():
            assert torch.equal(back[key], tensor), (use_dtensor, key)
    return "ok"


def test_one_rank_loads_into_fsdp_exactly():
    assert run_ranks(_one_rank_loads_into_fsdp, 1, timeout=120) == ["ok"]


def test_is_tp_sharded_follows_the_name_heuristic():
    assert _is_tp_sharded("layers.0.attention.wq.weight")
    assert _is_tp_sharded("layers.3.feed_forward.w2.weight")
    assert _is_tp_sharded("output.weight")
    assert _is_tp_sharded("tok_embeddings.weight")
    assert not _is_tp_sharded("norm.weight")
    assert not _is_tp_sharded("layers.0.ffn_norm.weight")


def _groups_made(made: list) -> tuple:
    """dist.new_group and dist.new_subgroups wrapped to keep the groups they make (mine, for subgroups)."""
    new_group, new_subgroups = dist.new_group, dist.new_subgroups

    def spy_group(*args, **kwargs):
        made.append(new_group(*args, **kwargs))
        return made[-1]

    def spy_subgroups(*args, **kwargs):
        mine, groups = new_subgroups(*args, **kwargs)
        made.append(mine)
        return mine, groups

    return spy_group, spy_subgroups


def _one_file_holds_a_tensor_whole() -> tuple[str, list[float]]:
    """MP rank 0's file holds w1 whole (from an MP 1 download), MP rank 1's its half: each shard passes the
    local shape checks, but rank 0 would skip the all-gather rank 1 waits in. Also the timeouts (s) of the
    groups the converter makes, read from each group's gloo backend."""
    rank = dist.get_rank()
    consolidated = consolidated_for("llama2", 2, rank)
    if rank == 0:
        consolidated["layers.0.feed_forward.w1.weight"] = full_weights("llama2")["layers.0.feed_forward.w1.weight"]
    made: list[dist.ProcessGroup] = []
    real = dist.new_group, dist.new_subgroups
    dist.new_group, dist.new_subgroups = _groups_made(made)
    try:
        build_distributed_state_dict_from_consolidated(Transformer(ARGS["llama2"]), consolidated, 2)
        message = "not raised"
    except CheckpointError as exc:
        message = str(exc)
    finally:
        dist.new_group, dist.new_subgroups = real
    return message, [group._get_backend(torch.device("cpu")).options._timeout.total_seconds() for group in made]


def test_shards_that_split_a_tensor_differently_fail_every_rank_without_a_hang(monkeypatch: pytest.MonkeyPatch):
    """Every rank fails at once, naming the tensor; and the converter's own groups wait no longer than
    TP_LLAMA_COLLECTIVE_TIMEOUT_S either (a new group's default is torch's 30 minutes, not the world group's)."""
    monkeypatch.setenv("TP_LLAMA_COLLECTIVE_TIMEOUT_S", "7")  # a spawned rank starts from this environment
    for message, timeouts in run_ranks(_one_file_holds_a_tensor_whole, 2, timeout=90):
        assert "layers.0.feed_forward.w1.weight" in message and "(96, 32) on rank 0" in message, message
        assert "(48, 32) on rank 1 (MP rank 1)" in message, message
        assert timeouts == [7.0, 7.0], timeouts
