"""Fixtures shared by the test modules; `--device` (or TP_LLAMA_TEST_DEVICE) for those that can run on CUDA."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.serving_util import TorchServe, live_server
from tp_llama.serving.settings import TORCHSERVE_KEYS
from tp_llama.testing.synthetic import write_checkpoint
from tp_llama.tokenizer import load_tokenizer

# What the served tests share unless they say otherwise: float32 (a reply compared with the same
# request alone or with the CLI must match exactly; bfloat16 rounding depends on the batch), small
# sequences and batches, short waits for a first batch.
SERVED = {"max_seq_len": 256, "max_new_tokens_limit": 200, "dtype": "float32", "max_batch_size": 4,
          "prefill_budget": 32, "maxBatchDelay": 20, "responseTimeout": 120}
STARTUP_TIMEOUT = 240


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path):
    """The tokenizer of the module's own `checkpoint` fixture."""
    return load_tokenizer(checkpoint / "tokenizer.model")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=os.environ.get("TP_LLAMA_TEST_DEVICE", "cpu"), choices=("cpu", "cuda"),
                     help="where the single-process model tests run (default cpu, or TP_LLAMA_TEST_DEVICE); "
                          "multi-rank tests stay on CPU with gloo")


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> str:
    """The device single-process model tests run on."""
    name = pytestconfig.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: this process sees no GPU")
    return name


@pytest.fixture(scope="session")
def synthetic_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make(family="llama2", mp=2, **options): a random-weight checkpoint in Meta's layout
    (tp_llama.testing.synthetic), written once per session for each set of options. Shared: a test
    that changes its files works on a copy."""
    made: dict[tuple, Path] = {}

    def make(family: str = "llama2", mp: int = 2, **options: Any) -> Path:
        key = (family, mp, tuple(sorted(options.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"ckpt-{family}-mp{mp}") / "ckpt"
            made[key] = write_checkpoint(folder, family=family, mp=mp, **options)
        return made[key]

    return make


def yaml_overrides(settings: dict[str, Any]) -> list[str]:
    """serve's keywords as model-config.yaml overrides: a handler setting by its name (max_seq_len),
    TorchServe's own keys by theirs (batchSize), a dict for a nested block (torchrun={...},
    lora_adapters={...}); None leaves the yaml's value."""
    out = []
    for key, value in settings.items():
        name = key if key in TORCHSERVE_KEYS else f"handler.{key}"
        if isinstance(value, dict):
            out += [f"{name}.{inner}={v}" for inner, v in value.items()]
        elif value is not None:
            out.append(f"{name}={value}")
    return out


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., AbstractContextManager[TorchServe]]:
    """serve(checkpoint, tp=2, env=None, extra_config=(), with_testing=False, **overrides): TorchServe
    serving `checkpoint` with SERVED's settings and these overrides (yaml_overrides), READY when the
    block starts and stopped when it ends."""

    @contextmanager
    def start(checkpoint: Path, *, tp: int = 2, env: dict[str, str] | None = None, extra_config: tuple = (),
              with_testing: bool = False, **overrides: Any) -> Iterator[TorchServe]:
        work = tmp_path_factory.mktemp("serve")
        with live_server(work, checkpoint, yaml_overrides({**SERVED, **overrides}), tp=tp, env=env,
                         startup_timeout=STARTUP_TIMEOUT, extra_config=extra_config, with_testing=with_testing) as ts:
            yield ts

    return start


@pytest.fixture(scope="module")
def meta():
    """Meta's own reference code and real Llama 3 tokenizer.model (llama-models, test-only): a missing
    oracle is a failure, never a skip."""
    try:
        from tests.support.meta_reference import load_meta_reference

        return load_meta_reference()
    except ImportError as err:
        pytest.fail(str(err))


@pytest.fixture(scope="session")
def real_tokenizer_compiler():
    """Meta's Llama 3 tokenizer (128,256 ids) and a grammar compiler over it."""
    from tests.support.meta_reference import load_meta_reference
    from tp_llama.engine.constraint import grammar_tokenizer
    from tp_llama.serving.grammars import GrammarCompiler
    from tp_llama.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(load_meta_reference().model_path)
    return tokenizer, GrammarCompiler(grammar_tokenizer(tokenizer))
