"""Fixtures shared by the test modules; `--device` (or TP_LLAMA_TEST_DEVICE) for those that can run on CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tp_llama.tokenizer import load_tokenizer


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
