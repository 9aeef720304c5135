"""CPU threads per rank when model-config.yaml leaves torchrun.OMP_NUMBER_THREADS unset.

TorchServe exports OMP_NUM_THREADS=1 unless the yaml sets the key, so the handler must size the
ranks' thread pools itself: the cores this process may use (affinity, capped by a cgroup quota) over
the ranks of its node. The test machines have 2 cores, so the computation is tested on affinity masks
and cgroup files written here, and the wiring through a real handler loading a tiny checkpoint.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tp_llama.serving.threads import ThreadChoice, cgroup_cpu_limit, choose_threads, threads_per_rank

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cpus, quota, ranks, expected", [
    (32, None, 1, 32), (32, None, 2, 16), (32, None, 4, 8),
    (32, 8.0, 1, 8), (32, 8.0, 2, 4), (32, 8.0, 4, 2),
    (32, 1.5, 1, 1), (32, 2.5, 2, 1), (32, 0.5, 4, 1),   # a fractional quota rounds down, never below 1
    (4, 16.0, 2, 2),                                      # the affinity mask is tighter than the quota
    (3, None, 2, 1), (3, None, 4, 1), (1, None, 1, 1),
])
def test_the_usable_cores_are_shared_between_the_ranks(cpus: int, quota: float | None, ranks: int,
                                                       expected: int) -> None:
    mask = set(range(64, 64 + cpus))  # any CPU ids: only how many count
    assert threads_per_rank(mask, quota, ranks) == expected
    assert choose_threads({}, affinity=mask, quota=quota, ranks=ranks, read_cgroup=False).threads == expected


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("self_cgroup, files, expected", [
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),                                    # v2, no quota
    ("0::/\n", {"cpu.max": "400000 100000\n"}, 4.0),                                  # v2 container, --cpus 4
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),
    ("0::/system.slice/ts.service\n", {"system.slice/ts.service/cpu.max": "200000 100000\n",
                                       "system.slice/cpu.max": "600000 100000\n"}, 2.0),  # the tightest on the path
    ("0::/a/b\n", {"a/cpu.max": "300000 100000\n", "a/b/cpu.max": "max 100000\n"}, 3.0),
    ("0::/\n", {}, None),                                                               # no cpu controller
    ("1:cpu:/\n2:cpuacct:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1
    ("4:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "250000\n",
                           "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 2.5),
    ("4:cpu,cpuacct:/docker/abc\n", {"cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
                                     "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 2.0),  # no cgroup namespace
    ("0::/\n", {"cpu.max": "garbage\n"}, None),
])
def test_cgroup_quotas_are_read_from_v1_and_v2(tmp_path: Path, self_cgroup: str, files: dict[str, str],
                                               expected: float | None) -> None:
    write(tmp_path / "fs", files)
    (tmp_path / "self").write_text(self_cgroup)
    assert cgroup_cpu_limit(tmp_path / "fs", tmp_path / "self") == expected


def test_a_quota_caps_the_threads_and_the_log_line_says_why(tmp_path: Path) -> None:
    write(tmp_path / "fs", {"cpu.max": "400000 100000\n"})
    (tmp_path / "self").write_text("0::/\n")
    quota = cgroup_cpu_limit(tmp_path / "fs", tmp_path / "self")
    choice = choose_threads({"nproc-per-node": 2}, affinity=range(32), quota=quota, ranks=2)
    assert choice == ThreadChoice(2, "torchrun.OMP_NUMBER_THREADS unset: 4 usable CPUs (affinity 32, cgroup quota 4) "
                                     "/ 2 ranks on this node")
    assert choice.log_line() == ("CPU threads: 2 per rank (torchrun.OMP_NUMBER_THREADS unset: 4 usable CPUs "
                                 "(affinity 32, cgroup quota 4) / 2 ranks on this node)")


def test_an_explicit_value_wins_and_oversubscription_is_named() -> None:
    assert choose_threads({"OMP_NUMBER_THREADS": 3}, affinity=range(32), ranks=2, read_cgroup=False).log_line() == (
        "CPU threads: 3 per rank (torchrun.OMP_NUMBER_THREADS: 3)")
    fits = choose_threads({"OMP_NUMBER_THREADS": 4}, affinity=range(8), ranks=2, read_cgroup=False)
    assert fits.threads == 4 and "exceed" not in fits.why
    over = choose_threads({"OMP_NUMBER_THREADS": 4}, affinity=range(6), ranks=2, read_cgroup=False)
    assert over.threads == 4 and "2 ranks x 4 threads exceed the 6 usable CPUs (affinity 6)" in over.why


def test_the_ranks_come_from_torchrun_then_the_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert choose_threads({"nproc-per-node": 2}, affinity=range(16), read_cgroup=False).threads == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert choose_threads({"nproc-per-node": 2}, affinity=range(16), read_cgroup=False).threads == 8


def test_the_shipped_yaml_leaves_the_threads_unset() -> None:
    """The default must be "all the cores": the key absent, not 1 (TorchServe's own default)."""
    config = yaml.safe_load((REPO / "model-config.yaml").read_text())
    assert "OMP_NUMBER_THREADS" not in config["torchrun"]


def openmp_max_threads() -> int:
    """The calling thread's OpenMP team size as torch's runtime (the C kernels' too) has it: torch.get_num_threads
    would set it first in a thread that has none yet. Other wheels load OpenMP runtimes of their own."""
    runtime = next(path for path in Path("/proc/self/maps").read_text().split()
                   if "libgomp" in path and Path(path).parent == (Path(torch.__file__).parent / "lib").resolve())
    return ctypes.CDLL(runtime).omp_get_max_threads()


def test_a_new_threads_team_starts_from_the_environment_and_the_step_thread_takes_the_main_ones() -> None:
    """Why StepThread sets its threads: a plain new thread's team is OMP_NUM_THREADS's, not the main thread's."""
    script = ("import threading, torch; from tests.test_threads import openmp_max_threads as n; "
              "from tp_llama.serving.step_thread import StepThread; torch.set_num_threads(2); seen = []; "
              "t = threading.Thread(target=lambda: seen.append(n())); t.start(); t.join(); "
              "print(n(), seen[0], StepThread().run(n))")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2", "1", "2"]  # main, a plain thread, the step thread


@pytest.mark.parametrize("torchrun, expected", [({}, None), ({"OMP_NUMBER_THREADS": 1}, 1)])
def test_the_handler_sets_the_threads_at_load(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch, torchrun: dict,
                                              expected: int | None) -> None:
    """The real handler's initialize on a one-process CPU engine: torch's thread count and the log line."""
    import handler.llama_handler as llama_handler
    from tp_llama.testing.synthetic import write_checkpoint

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, "llama3", 1, 64, 2, 4, 2, 512, 32, None, torch.float32, 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(llama_handler.gc, "freeze", lambda: None)  # leave the test process's collector alone
    expected = expected or choose_threads({}, ranks=1).threads
    context = SimpleNamespace(
        model_yaml_config={"deviceType": "cpu", "torchrun": {"nproc-per-node": 1, **torchrun},
                           "handler": {"ckpt_dir": str(ckpt), "dtype": "float32", "max_seq_len": 64,
                                       "max_batch_size": 2, "prefill_budget": 8}},
        system_properties={"model_dir": str(tmp_path)}, model_name="llama", metrics=None)
    before = torch.get_num_threads()
    torch.set_num_threads(1 if expected > 1 else 2)  # what TorchServe's OMP_NUM_THREADS left, or not
    try:
        with caplog.at_level(logging.INFO, logger=llama_handler.__name__):
            handler = llama_handler.LlamaHandler()
            handler.initialize(context)
        assert torch.get_num_threads() == expected
        # The thread that runs the steps (and the C kernels' parallel regions) has the same team.
        assert handler.steps.run(openmp_max_threads) == expected
    finally:
        torch.set_num_threads(before)
    lines = [r.getMessage() for r in caplog.records if "CPU threads" in r.getMessage()]
    assert len(lines) == 1 and f"CPU threads: {expected} per rank (torchrun.OMP_NUMBER_THREADS" in lines[0], lines


def test_a_served_worker_takes_its_share_of_the_cores_by_default(synthetic_checkpoint, serve) -> None:
    """Through TorchServe, whose yaml reaches the worker without the key: its OMP_NUM_THREADS=1 is not the
    last word, the rank logs why and serves on its share (TP 1 here, so all the cores it may use)."""
    expected = choose_threads({}, ranks=1)
    with serve(synthetic_checkpoint("llama3", mp=1), tp=1) as ts:
        assert ts.predict({"prompt": "Hello", "max_new_tokens": 2, "temperature": 0}).status == 200
        log = ts.model_log()
    assert f"rank 0: {expected.log_line()}" in log, [line for line in log.splitlines() if "threads" in line]
    assert f"rank 0/1 ready on cpu ({expected.threads} threads)" in log
