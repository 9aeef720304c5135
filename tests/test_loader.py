"""Direct tensor-parallel loading: every rank's piece, for any MP -> TP, read from only the files it needs,
with positioned reads that give exactly torch.load's values, and a peak memory of about the share."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tp_llama.errors import CheckpointError
from tp_llama.parallel.layout import full_shapes
from tp_llama.checkpoint.reader import ShardFiles, _Reader, read_local_shard

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


def test_rope_tables_at_the_top_and_inside_layers_are_dropped(tmp_path):
    """Llama 2 files write `rope.freqs`, the original LLaMA's one per layer: neither is a parameter."""
    paths = write_files(tmp_path, 1)
    state = torch.load(paths[0])
    state["rope.freqs"] = torch.arange(4.0)
    state["layers.0.attention.inner_attention.rope.freqs"] = torch.arange(4.0)
    torch.save(state, paths[0])
    files = ShardFiles(paths, {k: tuple(v.shape) for k, v in FULL.items()})
    assert torch.equal(files.tensor(0, "norm"), FULL["norm"])


# Positioned reads against torch.load, for both dtypes Meta ships and the conversions between them.
BIG = {
    "rows": (64, 40),  # split by file along dim 0
    "cols": (40, 64),  # split by file along dim 1
    "vec": (48,),      # whole in every file
}
BIG_SPLIT = {"rows": 0, "cols": 1, "vec": None}
READERS = {
    "default": {},
    "small blocks": {"block_bytes": 200},  # many blocks of a few rows, a block ending mid-tensor
    "row by row": {"row_direct_bytes": 1},  # every column slice read row by row straight into place
}


def write_big(folder, mp: int, dtype: torch.dtype) -> list:
    gen = torch.Generator().manual_seed(5)
    full = {key: torch.randn(shape, generator=gen).to(dtype) for key, shape in BIG.items()}
    paths = []
    for m in range(mp):
        state = {k: t.clone() if BIG_SPLIT[k] is None else t.chunk(mp, BIG_SPLIT[k])[m].clone() for k, t in full.items()}
        paths.append(folder / f"consolidated.{m:02d}.pth")
        torch.save(state, paths[-1])
    return paths


def torch_load_whole(paths: list, key: str) -> torch.Tensor:
    """The reference: every file read by torch.load (no mmap), concatenated along the file split."""
    pieces = [torch.load(p, weights_only=True)[key] for p in paths]
    return pieces[0] if BIG_SPLIT[key] is None else torch.cat(pieces, dim=BIG_SPLIT[key])


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("mp", [1, 2])
def test_positioned_reads_give_torch_load_values(tmp_path, file_dtype, target, reader, mp):
    paths = write_big(tmp_path, mp, file_dtype)
    files = ShardFiles(paths, BIG)
    for tp in (1, 2, 4):
        for key in BIG:
            for dim in ([None] if key == "vec" else [None, 0, 1]):
                want_whole = torch_load_whole(paths, key).to(target)
                for rank in range(tp if dim is not None else 1):
                    got = read_local_shard(files, key, BIG[key], dim, rank, tp, target, torch.device("cpu"),
                                           _Reader(**READERS[reader]))
                    want = want_whole if dim is None else want_whole.chunk(tp, dim)[rank]
                    assert got.dtype == target and torch.equal(got, want), (key, tp, dim, rank)
    # Every tensor was read from its place in the file, not through the mapping.
    assert all(files.offset(m, key) is not None for m in range(mp) for key in BIG)


def test_a_strided_file_tensor_is_copied_through_the_mapping(tmp_path):
    """A tensor saved as a transposed view has no row-major bytes to pread; the values still match."""
    base = torch.arange(40 * 64, dtype=torch.float32).reshape(40, 64)
    path = tmp_path / "consolidated.00.pth"
    torch.save({"rows": base.t(), "cols": base.clone(), "vec": torch.ones(48)}, path)
    files = ShardFiles([path], BIG)
    assert files.offset(0, "rows") is None and files.offset(0, "cols") is not None
    got = read_local_shard(files, "rows", BIG["rows"], 1, 1, 2, torch.bfloat16, torch.device("cpu"))
    assert torch.equal(got, base.t().chunk(2, 1)[1].bfloat16())


def test_a_file_cut_short_after_opening_names_file_and_tensor(tmp_path):
    paths = write_big(tmp_path, 1, torch.float32)
    files = ShardFiles(paths, BIG)
    offset = files.offset(0, "cols")
    with open(paths[0], "r+b") as f:
        f.truncate(offset + 10)
    with pytest.raises(CheckpointError, match=r"consolidated\.00\.pth: tensor 'cols': the file ends at byte"):
        read_local_shard(files, "cols", BIG["cols"], 0, 0, 1, torch.float32, torch.device("cpu"))


def test_peak_memory_is_the_share_not_the_file(tmp_path):
    """A one-rank load of ~100 MB: the peak resident set grows by about the weights, not twice that
    (mapped file pages kept resident while copying would double it)."""
    from tp_llama.model import ModelArgs

    args = ModelArgs(dim=512, n_layers=4, n_heads=8, n_kv_heads=8, vocab_size=16384, ffn_dim=1536, family="llama2")
    gen = torch.Generator().manual_seed(0)
    split = {"tok_embeddings.weight": 1, "output.weight": 0}
    split.update({k: 0 for k in full_shapes(args) if k.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight"))})
    split.update({k: 1 for k in full_shapes(args) if k.endswith(("wo.weight", "w2.weight"))})
    weights = {k: torch.randn(s, generator=gen) for k, s in full_shapes(args).items()}
    for m in range(2):
        torch.save({k: t.clone() if k not in split else t.chunk(2, split[k])[m].clone() for k, t in weights.items()},
                   tmp_path / f"consolidated.{m:02d}.pth")
    share = sum(t.numel() * 4 for t in weights.values())
    del weights
    script = f"""
import torch
from tp_llama.parallel.distributed import DistInfo
from tp_llama.checkpoint.loader import load_tp_model
from tp_llama.model import ModelArgs

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

try:
    open("/proc/self/clear_refs", "w").write("5")  # restart the peak counter
except OSError:
    pass
before = status("VmRSS")
model = load_tp_model({str(tmp_path)!r}, ModelArgs(**{args.__dict__!r}), DistInfo(0, 1, 0, torch.device("cpu"), "none"), torch.float32)
print("EXTRA", status("VmHWM") - before, "AFTER", status("VmRSS") - before)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert run.returncode == 0, run.stderr[-3000:]
    extra, after = (int(x) for x in run.stdout.split()[1::2])
    assert share > 90e6
    # 8 MB: the read buffer of the column-sliced embedding; the rest is the weights themselves.
    assert extra < 1.05 * share + 24e6, (extra / 1e6, share / 1e6)
    assert after < 1.05 * share + 8e6, (after / 1e6, share / 1e6)


def test_two_files_for_one_mp_rank_are_refused(tmp_path):
    """consolidated.0.pth beside consolidated.00.pth: both claim MP rank 0, and taking either would
    serve whichever the folder listing gave first."""
    from tp_llama.checkpoint.shards import find_shards

    paths = write_files(tmp_path, 2)
    (tmp_path / "consolidated.0.pth").write_bytes(paths[1].read_bytes())
    with pytest.raises(CheckpointError, match=r"consolidated\.0\.pth and consolidated\.00\.pth|"
                                              r"consolidated\.00\.pth and consolidated\.0\.pth"):
        find_shards(tmp_path)
    (tmp_path / "consolidated.0.pth").unlink()
    assert find_shards(tmp_path) == paths


def test_an_empty_shard_names_file_and_tensor(tmp_path):
    """A tensor with no rows where the full one has 16 is no split of it (and no division by zero)."""
    paths = write_files(tmp_path, 2)
    state = torch.load(paths[1])
    state["rows"] = state["rows"][:0]
    torch.save(state, paths[1])
    files = ShardFiles(paths, {k: tuple(v.shape) for k, v in FULL.items()})
    with pytest.raises(CheckpointError, match=r"consolidated\.01\.pth: tensor 'rows' has shape \(0, 8\)"):
        read_local_shard(files, "rows", (16, 8), 0, 1, 2, torch.float32, torch.device("cpu"))
