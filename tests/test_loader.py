"""Direct tensor-parallel loading: every rank's piece, for any MP -> TP, read from only the files it needs."""

from __future__ import annotations

import pytest
import torch

from tp_llama.errors import CheckpointError
from tp_llama.loader import ShardFiles, read_local_shard

FULL = {
    "rows": torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8),
    "cols": torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16) * -1,
    "norm": torch.arange(8, dtype=torch.float32) + 0.5,
}
FILE_SPLIT = {"rows": 0, "cols": 1, "norm": None}


def write_files(folder, mp: int, file_split=FILE_SPLIT) -> list:
    paths = []
    for m in range(mp):
        state = {
            key: tensor.clone() if file_split[key] is None else tensor.chunk(mp, dim=file_split[key])[m].clone()
            for key, tensor in FULL.items()
        }
        path = folder / f"consolidated.{m:02d}.pth"
        torch.save(state, path)
        paths.append(path)
    return paths


@pytest.mark.parametrize("mp", [1, 2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("key,dim", [("rows", 0), ("cols", 1), ("norm", None), ("rows", 1), ("cols", 0)])
def test_each_rank_gets_exactly_its_slice(tmp_path, mp, tp, key, dim):
    """Includes target dims that differ from the file split (rows split by file, sharded by column)."""
    paths = write_files(tmp_path, mp)
    expected_shapes = {k: tuple(v.shape) for k, v in FULL.items()}
    for rank in range(tp):
        files = ShardFiles(paths, expected_shapes)
        local = read_local_shard(files, key, expected_shapes[key], dim, rank, tp, torch.float64, torch.device("cpu"))
        want = FULL[key] if dim is None else FULL[key].chunk(tp, dim=dim)[rank]
        assert local.dtype == torch.float64
        assert torch.equal(local, want.double())


@pytest.mark.parametrize("mp,tp,rank,needed", [(4, 2, 0, [0, 1]), (4, 2, 1, [2, 3]), (8, 2, 1, [4, 5, 6, 7]),
                                                (2, 4, 3, [1]), (1, 4, 2, [0])])
def test_rank_opens_only_the_files_it_needs(tmp_path, mp, tp, rank, needed):
    paths = write_files(tmp_path, mp)
    expected_shapes = {k: tuple(v.shape) for k, v in FULL.items()}
    files = ShardFiles(paths, expected_shapes)
    for key in FULL:
        read_local_shard(files, key, expected_shapes[key], FILE_SPLIT[key], rank, tp, torch.float32, torch.device("cpu"))
    assert files.files_read() == [paths[m] for m in needed]


def test_a_shape_that_fits_no_split_names_file_and_tensor(tmp_path):
    paths = write_files(tmp_path, 2)
    state = torch.load(paths[1])
    state["rows"] = state["rows"][:3]
    torch.save(state, paths[1])
    expected_shapes = {k: tuple(v.shape) for k, v in FULL.items()}
    files = ShardFiles(paths, expected_shapes)
    with pytest.raises(CheckpointError, match=r"consolidated\.01\.pth.*'rows'"):
        read_local_shard(files, "rows", (16, 8), 0, 1, 2, torch.float32, torch.device("cpu"))


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    paths = write_files(tmp_path, 1)
    state = torch.load(paths[0])
    del state["norm"]
    state["extra.weight"] = torch.zeros(2)
    torch.save(state, paths[0])
    files = ShardFiles(paths, {k: tuple(v.shape) for k, v in FULL.items()})
    with pytest.raises(CheckpointError, match=r"consolidated\.00\.pth: missing tensor 'norm'"):
        files.tensor(0, "rows")
