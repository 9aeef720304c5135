"""Fixtures shared by the server test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tp_llama.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path):
    """The tokenizer of the module's own `checkpoint` fixture."""
    return load_tokenizer(checkpoint / "tokenizer.model")
