"""Every key of model-config.yaml is checked, and setup_model.sh's --set / --threads reach the model folder.

TorchServe itself only warns about an unknown key and resets a wrong type to its default, so a typo
(`OMP_NUM_THREADS` for `OMP_NUMBER_THREADS`) would serve silently with the wrong setting. The worker
refuses such a yaml at load (check_model_config) and make_archive refuses it when writing the folder.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.make_archive import apply_override, build_archive, model_config
from tp_llama.serving.settings import TORCHRUN_KEYS, TORCHSERVE_KEYS, check_model_config

REPO = Path(__file__).resolve().parents[1]
SHIPPED = yaml.safe_load((REPO / "model-config.yaml").read_text())


def test_the_shipped_yaml_passes() -> None:
    assert check_model_config(SHIPPED).engine.max_seq_len == SHIPPED["handler"]["max_seq_len"]


def with_(dotted: str, value: object) -> dict:
    """The shipped yaml with one key (`block.key` or `key`) set to value."""
    config = yaml.safe_load((REPO / "model-config.yaml").read_text())
    apply_override(config, f"{dotted}={yaml.safe_dump(value, default_flow_style=True).strip()}")
    return config


@pytest.mark.parametrize("config, message", [
    ({**SHIPPED, "batchsize": 80}, r"unknown key 'batchsize' \(did you mean batchSize\?\)"),
    ({**SHIPPED, "OMP_NUMBER_THREADS": 4}, r"unknown key 'OMP_NUMBER_THREADS'"),
    (with_("torchrun.OMP_NUM_THREADS", 4), r"unknown key torchrun.OMP_NUM_THREADS \(did you mean OMP_NUMBER_THREADS\?\)"),
    (with_("torchrun.OMP_NUMBER_THREADS", "4"), r"torchrun.OMP_NUMBER_THREADS must be an integer >= 1, got '4'"),
    (with_("torchrun.OMP_NUMBER_THREADS", 0), r"torchrun.OMP_NUMBER_THREADS must be an integer >= 1, got 0"),
    (with_("torchrun.nproc-per-node", True), r"torchrun.nproc-per-node must be an integer >= 1, got True"),
    (with_("torchrun.rdzv-endpoint", 29400), r"torchrun.rdzv-endpoint must be a string, got 29400"),
    (with_("batchSize", "80"), r"batchSize must be an integer >= 1, got '80'"),
    (with_("maxBatchDelay", -1), r"maxBatchDelay must be an integer >= 0, got -1"),
    # TorchServe ignores (warns) or raises to 1 what is below 1 here; the handler would end every request at once.
    (with_("responseTimeout", 0), r"responseTimeout must be an integer >= 1, got 0"),
    (with_("startupTimeout", 0), r"startupTimeout must be an integer >= 1, got 0"),
    (with_("minWorkers", 0), r"minWorkers must be an integer >= 1, got 0"),
    (with_("torchrun.monitor-interval", 0), r"torchrun.monitor-interval must be an integer >= 1, got 0"),
    (with_("continuousBatching", "yes"), r"continuousBatching must be true or false, got 'yes'"),
    (with_("deviceIds", [0, "1"]), r"deviceIds must be a list of GPU ids, got \[0, '1'\]"),
    (with_("deviceType", "cuda"), r"deviceType must be one of \['cpu', 'gpu'\], got 'cuda'"),
    (with_("torchrun", [1]), r"torchrun must be a mapping, got \[1\]"),
    (with_("handler.max_seqlen", 4096), r"unknown key\(s\) in the handler block of model-config.yaml: \['max_seqlen'\]"),
    (with_("handler.max_seq_len", "4096"), r"handler.max_seq_len must be an integer"),
    ({**SHIPPED, "handler": "ckpt"}, r"handler must be a mapping"),
    ({**SHIPPED, "handler": {**SHIPPED["handler"], 1: 2, "foo": 3}}, r"model-config.yaml: \[1, 'foo'\]"),
])
def test_a_wrong_key_or_type_is_refused_by_name(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_model_config(config)


def test_every_torchserve_and_torchrun_key_of_the_shipped_yaml_is_known() -> None:
    assert set(SHIPPED) - {"handler"} <= set(TORCHSERVE_KEYS)
    assert set(SHIPPED["torchrun"]) <= set(TORCHRUN_KEYS)
    assert "OMP_NUMBER_THREADS" in TORCHRUN_KEYS and "handler" not in TORCHSERVE_KEYS


@pytest.mark.parametrize("assignment, path, value", [
    ("handler.max_seq_len=4096", ("handler", "max_seq_len"), 4096),
    ("torchrun.OMP_NUMBER_THREADS=4", ("torchrun", "OMP_NUMBER_THREADS"), 4),
    ("handler.kv_cache_memory_gb=1.5", ("handler", "kv_cache_memory_gb"), 1.5),
    ("handler.prefix_caching=false", ("handler", "prefix_caching"), False),
    ("handler.dtype=bfloat16", ("handler", "dtype"), "bfloat16"),
    ("handler.dtype=null", ("handler", "dtype"), None),
    ("torchrun.rdzv-endpoint=127.0.0.1:0", ("torchrun", "rdzv-endpoint"), "127.0.0.1:0"),
    ("deviceIds=[0, 1]", ("deviceIds",), [0, 1]),
    ("handler.lora_adapters.sql=/adapters/sql", ("handler", "lora_adapters", "sql"), "/adapters/sql"),  # null before
])
def test_set_writes_the_value_with_its_yaml_type(tmp_path: Path, assignment: str, path: tuple, value: object) -> None:
    config = model_config(REPO / "model-config.yaml", tmp_path, 2, [assignment])
    node = config
    for part in path:
        node = node[part]
    assert node == value and type(node) is type(value)
    assert config["torchrun"]["nproc-per-node"] == 2 and config["handler"]["ckpt_dir"] == str(tmp_path)


@pytest.mark.parametrize("assignment, message", [
    ("handler.max_seqlen=4096", "unknown key"),
    ("torchrun.OMP_NUMBER_THREADS=four", "must be an integer"),
    ("batchSize.x=1", "batchSize is not a block of keys"),
    ("handler.max_seq_len", "KEY=VALUE"),
    ("handler.dtype=[", "not YAML"),
    ("handler.speculative=off", "unquoted off, on, yes or no as a boolean: quote it"),
    ("handler.ckpt_dir=/elsewhere", "may not change handler.ckpt_dir: name the checkpoint folder with --ckpt-dir"),
    ("handler={mode: tp}", "--set may not change handler.ckpt_dir"),
])
def test_set_refuses_what_the_worker_would(tmp_path: Path, assignment: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_config(REPO / "model-config.yaml", tmp_path, 2, [assignment])


@pytest.mark.parametrize("text, message", [("", "is a mapping"), ("- a\n", "is a mapping"),
                                           ("handler: 3\n", "blocks of keys"), ("a: [\n", "not YAML")])
def test_a_config_file_that_is_no_mapping_is_named(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ValueError, match=f"config.yaml: .*{message}"):
        model_config(tmp_path / "config.yaml", tmp_path, 2, [])


def fake_repo(tmp_path: Path) -> tuple[Path, Path]:
    """setup_model.sh in a folder of its own whose venv Python only records its arguments, with the stamp
    that says the requirements are installed: the script's own logic runs, nothing is installed."""
    repo = tmp_path / "repo"
    (repo / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(REPO / "setup_model.sh", repo / "setup_model.sh")
    for name in ("requirements.txt", "pyproject.toml"):
        shutil.copy(REPO / name, repo / name)
    stamp = subprocess.run(f"cat {repo}/requirements.txt {repo}/pyproject.toml | sha256sum | cut -d' ' -f1",
                           shell=True, capture_output=True, text=True, check=True).stdout
    (repo / ".venv" / ".tp-llama-serve-installed").write_text(stamp)
    log = tmp_path / "calls"
    python = repo / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\n')
    python.chmod(0o755)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("params.json", "tokenizer.model", "consolidated.00.pth"):
        (ckpt / name).write_text("")
    return repo, ckpt


needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="setup_model.sh checks Java 17 first")


@needs_java
def test_setup_passes_threads_and_set_to_the_model_folder(tmp_path: Path) -> None:
    repo, ckpt = fake_repo(tmp_path)
    done = subprocess.run([str(repo / "setup_model.sh"), "--ckpt-dir", str(ckpt), "--tp", "2", "--threads", "3",
                           "--set", "handler.max_seq_len=8192", "--set", "handler.dtype=bfloat16",
                           "--model-store", str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 0, done.stderr
    archive = [line for line in (tmp_path / "calls").read_text().splitlines() if "make_archive.py" in line]
    assert len(archive) == 1
    assert archive[0].endswith("--set handler.max_seq_len=8192 --set handler.dtype=bfloat16 "
                               "--set torchrun.OMP_NUMBER_THREADS=3"), archive[0]
    assert "--set handler.max_seq_len=8192 --set handler.dtype=bfloat16 --set torchrun.OMP_NUMBER_THREADS=3 " \
        in done.stdout  # the rerun command it prints keeps them


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads must be a positive integer"),
    (["--threads", "all"], "--threads must be a positive integer"),
    (["--set", "handler.max_seq_len"], "--set needs KEY=VALUE"),
    (["--set"], "--set needs KEY=VALUE"),
])
def test_setup_refuses_bad_flags_before_doing_anything(tmp_path: Path, args: list[str], message: str) -> None:
    repo, _ = fake_repo(tmp_path)
    done = subprocess.run([str(repo / "setup_model.sh"), *args, "--model-store", str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "calls").exists()


@needs_java
def test_setup_takes_a_checkpoint_folder_that_is_a_symlink(tmp_path: Path) -> None:
    repo, ckpt = fake_repo(tmp_path)
    (tmp_path / "link").symlink_to(ckpt, target_is_directory=True)  # the weights on another disk, say
    done = subprocess.run([str(repo / "setup_model.sh"), "--ckpt-dir", str(tmp_path / "link"),
                           "--model-store", str(tmp_path / "store")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "(1 shard file(s))" in done.stdout


@needs_java
def test_the_rerun_command_setup_prints_keeps_paths_with_spaces_whole(tmp_path: Path) -> None:
    repo, ckpt = fake_repo(tmp_path)
    spaced = ckpt.rename(tmp_path / "my ckpt")
    store = tmp_path / "model store"
    done = subprocess.run([str(repo / "setup_model.sh"), "--ckpt-dir", str(spaced), "--tp", "1",
                           "--model-store", str(store)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rerun = done.stdout.rsplit("To serve it: ", 1)[1].strip()
    assert shlex.split(rerun) == ["./setup_model.sh", "--ckpt-dir", str(spaced), "--tp", "1", "--name", "llama",
                                  "--model-store", str(store), "--serve"]


@needs_java
def test_serve_stops_at_the_first_failed_load_with_its_cause(tmp_path: Path) -> None:
    """TorchServe retries a failed load for good: setup shows the ranks' output and stops the server at the
    first failure instead of waiting READY_TIMEOUT. TorchServe here is a stand-in that fails its load."""
    repo, ckpt = fake_repo(tmp_path)
    bin_dir, temp = repo / ".venv" / "bin", tmp_path / "temp"
    temp.mkdir()
    python = bin_dir / "python"
    # The real interpreter only for the pid file's path; no port is busy.
    stand_in = f'#!/bin/sh\n[ "$1" = -c ] && exec {sys.executable} "$@"\n[ "$1" = - ] && exit 1\n'
    python.write_text(python.read_text().replace("#!/bin/sh\n", stand_in))
    torchserve = bin_dir / "torchserve"
    torchserve.write_text(f"""#!/bin/sh
case "$1" in
  --start) sleep 120 > /dev/null 2>&1 & echo $! > "$TMPDIR/.model_server.pid"; echo "Load model failed: llama" ;;
  --stop) kill "$(cat "$TMPDIR/.model_server.pid")"; echo stopped >> {tmp_path / "calls"} ;;
esac
""")
    torchserve.chmod(0o755)
    (repo / "logs").mkdir()
    (repo / "logs" / "model_log.log").write_text("rank 0] the cause, named\n")
    done = subprocess.run([str(repo / "setup_model.sh"), "--ckpt-dir", str(ckpt), "--model-store",
                           str(tmp_path / "store"), "--serve"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(temp), "READY_TIMEOUT": "50"})
    assert done.returncode == 1 and "the worker failed to load the model" in done.stderr, (done.stdout, done.stderr)
    assert "the cause, named" in done.stdout and "stopped" in (tmp_path / "calls").read_text().splitlines()


def test_the_model_folder_refuses_a_tp_that_cuts_a_head(synthetic_checkpoint, tmp_path: Path) -> None:
    """The worker would refuse it at load, again at every retry, while setup waited READY_TIMEOUT."""
    ckpt = synthetic_checkpoint()  # 8 heads, 4 KV heads
    with pytest.raises(ValueError, match=r"tensor-parallel size 3 does not divide n_heads \(8\)"):
        build_archive(ckpt, tmp_path / "store", tp=3)
    with pytest.raises(ValueError, match=r"tensor-parallel size 8 does not divide n_kv_heads \(4\)"):
        build_archive(ckpt, tmp_path / "store", tp=2, overrides=["torchrun.nproc-per-node=8"])
    assert not (tmp_path / "store" / "llama").exists()


def test_the_model_folder_refuses_an_fsdp_world_that_splits_the_shard_files(synthetic_checkpoint,
                                                                              tmp_path: Path) -> None:
    """fsdp mode's loader needs a world size that is a multiple of the MP size; the worker would
    refuse any other at every retry, as it refuses a TP size that cuts a head."""
    ckpt = synthetic_checkpoint()  # MP 2
    with pytest.raises(ValueError, match=r"multiple of the checkpoint's MP size 2, got 3"):
        build_archive(ckpt, tmp_path / "store", tp=3, overrides=["handler.mode=fsdp"])
    assert not (tmp_path / "store" / "llama").exists()
