"""Incremental detokenisation for streamed replies.

One token can hold part of a multi-byte character (byte-fallback pieces in SentencePiece,
byte-level BPE in tiktoken), and decoding a partial sequence yields U+FFFD. Text is only
emitted once it can no longer change, so the streamed pieces always add up to the final
decoded text.
"""

from __future__ import annotations

import os
from collections.abc import Callable

REPLACEMENT = "\ufffd"


class StreamDecoder:
    """Feeds token ids in, hands back only the text that is stable."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, ids: list[int]) -> str:
        """Add new ids; return the newly stable text (maybe empty)."""
        self._ids.extend(ids)
        text = self._decode(self._ids)
        if text.endswith(REPLACEMENT) or not text.startswith(self._emitted):
            return ""
        return self._take(text)

    def finish(self) -> str:
        """Everything not yet emitted, once no more ids will come."""
        text = self._decode(self._ids)
        # Stable text never changes with Llama's tokenizers; if it did, resume where they agree.
        self._emitted = os.path.commonprefix([text, self._emitted])
        return self._take(text)

    def _take(self, text: str) -> str:
        delta = text[len(self._emitted):]
        self._emitted = text
        return delta
