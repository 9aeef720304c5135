"""Meta's own Llama 3 tokenizer and chat format, used by the tests as an independent oracle.

They come from the PyPI package ``llama-models`` (a test-only dependency, see
requirements-test.txt), which ships Meta's real 128,256-id ``tokenizer.model`` next to its
reference ``Tokenizer`` and ``ChatFormat``. Only those two modules are imported: they need
tiktoken, pydantic and Pillow, not torch, fairscale or torchvision.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = (
    "Meta's reference tokenizer is missing: run "
    "`.venv/bin/python -m pip install -r requirements-test.txt` and "
    "`.venv/bin/python -m pip install --no-deps llama-models==0.3.0`"
)


@dataclass
class MetaReference:
    """Meta's tokenizer, its chat format, and the path of the tokenizer.model they read."""

    model_path: Path
    tokenizer: object  # llama_models.llama3.tokenizer.Tokenizer
    chat_format: object  # llama_models.llama3.chat_format.ChatFormat

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        return self.tokenizer.encode(text, bos=bos, eos=eos)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def split(self, text: str, slice_chars: int, max_run: int) -> list[str]:
        """The pieces Meta's ``encode`` hands to tiktoken, with the thresholds as arguments.

        Meta's ``encode`` slices the text itself and then calls its run splitter on each slice;
        the slicing line is restated here so the thresholds can be made small.
        """
        split = self.tokenizer._split_whitespaces_or_nonwhitespaces
        return [
            piece
            for i in range(0, len(text), slice_chars)
            for piece in split(text[i : i + slice_chars], max_run)
        ]

    def encode_dialog(self, messages: list[dict]) -> list[int]:
        """Meta's ``ChatFormat.encode_dialog_prompt`` on {'role', 'content'} dicts."""
        from llama_models.datatypes import RawMessage

        raw = [RawMessage(role=m["role"], content=m["content"]) for m in messages]
        return list(self.chat_format.encode_dialog_prompt(raw).tokens)


def load_meta_reference() -> MetaReference:
    """Load Meta's tokenizer from the installed llama_models package; ImportError if absent."""
    try:
        from llama_models.llama3.chat_format import ChatFormat
        from llama_models.llama3.tokenizer import Tokenizer
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    resource = importlib.resources.files("llama_models.llama3") / "tokenizer.model"
    model_path = Path(str(resource))
    if not model_path.is_file():
        raise ImportError(f"llama_models has no tokenizer.model at {model_path}")
    tokenizer = Tokenizer(model_path)
    return MetaReference(model_path, tokenizer, ChatFormat(tokenizer))
