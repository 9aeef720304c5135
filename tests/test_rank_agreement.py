"""every_rank_agrees: a failure on one rank ends every rank together, with each rank's cause named;
and it is the only way the code reaches that verdict."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.dist_util import run_ranks
from tp_llama.errors import CheckpointError
from tp_llama.parallel.distributed import every_rank_agrees

REPO = Path(__file__).resolve().parents[1]


def _block(failing: dict[int, BaseException]) -> str:
    """Runs on each rank: the block fails on the ranks in `failing`; returns what every rank saw."""
    import torch.distributed as dist

    rank = dist.get_rank()
    value = None
    try:
        with every_rank_agrees():
            value = f"made on rank {rank}"
            if rank in failing:
                raise failing[rank]
    except Exception as exc:  # noqa: BLE001 - the verdict is what this test reads
        return f"{type(exc).__name__}: {exc}"
    return value


SCENARIOS = {
    "none": {},
    "one": {1: CheckpointError("consolidated.01.pth: cannot be read")},
    "different": {0: CheckpointError("params.json: bad"), 1: MemoryError("pool")},
}


def _blocks(scenarios: dict[str, dict[int, BaseException]]) -> dict[str, str]:
    """Each scenario's block in turn on this rank, in one process group (each meeting ends before the next)."""
    return {name: _block(failing) for name, failing in scenarios.items()}


@pytest.fixture(scope="module")
def seen() -> dict[str, list[str]]:
    """What each of 3 ranks saw in each scenario: one group for all of them (a group of spawned ranks
    costs a torch import each)."""
    by_rank = run_ranks(_blocks, 3, SCENARIOS, timeout=60)
    return {name: [ranks[name] for ranks in by_rank] for name in SCENARIOS}


def test_no_failure_lets_every_rank_go_on_with_what_its_block_made(seen):
    assert seen["none"] == ["made on rank 0", "made on rank 1", "made on rank 2"]


def test_one_rank_failing_fails_every_rank_with_its_cause(seen):
    assert seen["one"] == ["CheckpointError: rank 1: CheckpointError: consolidated.01.pth: cannot be read"] * 3


def test_different_failures_are_all_named_and_not_all_checkpoint_errors_make_a_runtime_error(seen):
    """Rank 2's block went well: only the failures are named."""
    assert seen["different"] == ["RuntimeError: rank 0: CheckpointError: params.json: bad; rank 1: MemoryError: pool"] * 3


def test_alone_the_error_is_raised_as_it_is():
    with pytest.raises(MemoryError, match="^pool$"):
        with every_rank_agrees():
            raise MemoryError("pool")


def _calls_named(tree: ast.AST, suffix: str) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and (getattr(node.func, "id", None) or getattr(node.func, "attr", "")).endswith(suffix)]


def test_ranks_agree_only_through_every_rank_agrees():
    """The meeting after a block is every_rank_agrees' own: a try / except / raise_if_any_rank_failed
    written out again at a call site would be a second way to get it wrong."""
    outside = []
    for root in ("tp_llama", "handler", "bench", "tests"):
        for path in (REPO / root).rglob("*.py"):
            if path.is_relative_to(REPO / "bench" / "out"):  # git-ignored: peers' sources and virtualenvs
                continue
            tree = ast.parse(path.read_text(), str(path))
            allowed: set[int] = set()
            if path == REPO / "tp_llama" / "parallel" / "distributed.py":
                agree = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "every_rank_agrees")
                allowed = {id(call) for call in _calls_named(agree, "raise_if_any_rank_failed")}
                assert allowed, "every_rank_agrees no longer gathers the ranks' errors"
            outside += [f"{path.relative_to(REPO)}:{call.lineno}" for call in _calls_named(tree, "raise_if_any_rank_failed")
                        if id(call) not in allowed]
    assert not outside, f"called outside every_rank_agrees: {outside}"
