"""Broken checkpoints, and faults injected on one rank, fail fast on every rank with the cause named."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.cli_util import launch_cli
from tp_llama.testing.faults import fault_env
from tp_llama.testing.synthetic import main as synthetic_main
from tp_llama.testing.synthetic import write_checkpoint

# The ranks' interpreter start-ups included, with the suite's other worker busy on the same cores. A hang
# cannot pass for a failure: no collective times out before launch_cli's limit.
FAIL_FAST_S = 100
COLLECTIVE_TIMEOUT_S = "600"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("good") / "ckpt", family="llama2", mp=2)


@pytest.fixture
def ckpt(good, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(good, copy)
    return copy


def failed_run(ckpt: Path, world: int, mode: str, env: dict | None = None):
    run = launch_cli(["--ckpt-dir", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2", "--mode", mode], world,
                     env={"TP_LLAMA_COLLECTIVE_TIMEOUT_S": COLLECTIVE_TIMEOUT_S, **(env or {})})
    assert run.returncode != 0, run.stdout
    assert run.seconds < FAIL_FAST_S, f"took {run.seconds:.1f} s"
    return run


def fails_on_every_rank(ckpt: Path, world: int, pattern: str, mode: str = "tp", env: dict | None = None) -> str:
    run = failed_run(ckpt, world, mode, env)
    errors = [line for line in run.stderr.splitlines() if "] error:" in line]
    ranks = {int(m.group(1)) for line in errors if (m := re.search(r"rank (\d+)\] error:", line))}
    assert ranks == set(range(world)), run.stderr
    assert all(re.search(pattern, line) for line in errors), errors
    return run.stderr


def test_missing_shard_file(ckpt):
    (ckpt / "consolidated.00.pth").unlink()
    fails_on_every_rank(ckpt, 2, r"missing shard file\(s\) consolidated\.00\.pth")


def test_missing_last_shard_file_is_seen_from_shapes(ckpt):
    (ckpt / "consolidated.01.pth").unlink()
    fails_on_every_rank(ckpt, 2, r"consolidated\.00\.pth: .*split over 2 files but 1 consolidated")


def test_truncated_file_seen_by_one_rank_only(ckpt):
    """MP 2 onto TP 2: only rank 1 opens file 01, yet rank 0 must fail too, naming it."""
    path = ckpt / "consolidated.01.pth"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    fails_on_every_rank(ckpt, 2, r"rank 1: CheckpointError: .*consolidated\.01\.pth: cannot be read")


def test_wrong_params_json_names_the_key(ckpt):
    params = json.loads((ckpt / "params.json").read_text())
    params["n_heads"] = "eight"
    (ckpt / "params.json").write_text(json.dumps(params))
    fails_on_every_rank(ckpt, 2, r"params\.json: key 'n_heads' has invalid value 'eight'")


def test_params_that_disagree_with_the_tensors(ckpt):
    params = json.loads((ckpt / "params.json").read_text())
    params["dim"] = 256
    (ckpt / "params.json").write_text(json.dumps(params))
    fails_on_every_rank(ckpt, 2, r"consolidated\.0[01]\.pth: tensor 'tok_embeddings\.weight' has shape")


def test_missing_tensor_is_named(ckpt):
    path = ckpt / "consolidated.00.pth"
    state = torch.load(path)
    del state["layers.1.ffn_norm.weight"]
    torch.save(state, path)
    fails_on_every_rank(ckpt, 2, r"consolidated\.00\.pth: missing tensor 'layers\.1\.ffn_norm\.weight'", mode="fsdp")


def test_tp_size_that_cuts_kv_heads(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", family="llama3", mp=1, dim=96, n_heads=6, n_kv_heads=3, vocab_size=768)
    fails_on_every_rank(ckpt, 2, r"tensor-parallel size 2 does not divide n_kv_heads \(3\)")


def test_fsdp_world_size_not_multiple_of_mp(ckpt):
    fails_on_every_rank(ckpt, 1, r"multiple of the checkpoint's MP size 2", mode="fsdp")


class _Marker:
    """Pickles to a call that would create a file; weights_only loading must refuse to run it."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_pickled_callable_is_refused_and_never_run(ckpt, tmp_path):
    marker = tmp_path / "executed"
    state = torch.load(ckpt / "consolidated.00.pth")
    state["payload"] = _Marker(marker)
    torch.save(state, ckpt / "consolidated.00.pth")
    fails_on_every_rank(ckpt, 2, r"consolidated\.00\.pth: cannot be read.*(Weights only load failed|Unsupported)")
    assert not marker.exists()


def _fault_env(tmp_path: Path, fault: dict) -> dict:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps([fault]))
    return fault_env(path)


def test_out_of_memory_on_one_rank_fails_every_rank(ckpt, tmp_path):
    env = _fault_env(tmp_path, {"point": "load", "kind": "oom", "rank": 1})
    fails_on_every_rank(ckpt, 2, r"rank 1: RuntimeError: .*can't allocate memory", env=env)


def test_exception_in_the_converter_on_one_rank_ends_the_group(ckpt, tmp_path):
    """Rank 1 fails inside the FSDP converter while rank 0 waits in its all-gather: no hang."""
    env = _fault_env(tmp_path, {"point": "convert", "kind": "exception", "rank": 1})
    run = failed_run(ckpt, 2, "fsdp", env)
    assert re.search(r"rank 1\] error: injected fault at convert on rank 1", run.stderr), run.stderr[-3000:]


def test_a_tokenizer_with_ids_past_the_embedding_is_refused_at_load(tmp_path):
    """A checkpoint converted from another format (SmolLM2's): an embedding with a row per BPE rank and
    none for the 256 special ids Llama 3's layout appends, so <|begin_of_text|> is one past the last row.
    Every rank refuses it at load, naming the files, the counts and the fix, instead of serving until
    the first text request kills the worker."""
    ckpt = write_checkpoint(tmp_path / "ckpt", family="llama3", vocab_size=512, model_vocab=256)
    fails_on_every_rank(ckpt, 2, r"tokenizer\.model: the tokenizer makes 512 ids \(llama3 format\) but .*params\.json "
                                 r"has vocab_size 256.*ids 256 to 511 have no row \(256 of its special ids among them: "
                                 r"<\|begin_of_text\|> \(256\), <\|end_of_text\|> \(257\).*padded to 512 rows")


def test_a_tokenizer_with_fewer_ids_than_the_embedding_serves_text(tmp_path):
    """The other side of the rule: an embedding padded past the tokenizer's ids (as some of Meta's are)
    loads and answers a text prompt, picking only ids the tokenizer can decode (random weights would
    pick a padded row's id about one time in five)."""
    ckpt = write_checkpoint(tmp_path / "ckpt", family="llama3", vocab_size=512, model_vocab=640)
    run = launch_cli(["--ckpt-dir", str(ckpt), "--prompt", "hello there", "--max-new-tokens", "24", "--ignore-eos",
                      "--temperature", "1.0", "--seed", "3"], 2)
    assert run.returncode == 0, run.stderr[-3000:]
    ids = json.loads(run.stdout.splitlines()[0])["token_ids"]
    assert len(ids) == 24 and max(ids) < 512, ids


def test_the_synthetic_writer_refuses_an_mp_that_cuts_a_head(tmp_path: Path, capfd) -> None:
    """MP 3 of 8 heads wrote files that no loader reads; MP 0 stopped with a traceback."""
    for mp, message in ((3, "mp 3 must divide n_heads (8), n_kv_heads (4)"), (0, "mp must be >= 1, got 0")):
        with pytest.raises(SystemExit) as stopped:
            synthetic_main([str(tmp_path / f"mp{mp}"), "--mp", str(mp)])
        assert stopped.value.code == 2 and message in capfd.readouterr().err
        assert not list((tmp_path / f"mp{mp}").glob("consolidated.*.pth"))
