"""Incremental detokenisation for streamed replies, and stop strings watched for in the text.

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


class StopWatcher:
    """Cuts generated text before the first stop string, holding back text that may begin one.

    `feed` takes newly stable text and returns the part that is safe to show, plus whether a
    stop string was found (then nothing after it is ever shown).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""
        self.shown = 0
        self.hit = False

    def feed(self, piece: str, final: bool = False) -> str:
        if self.hit:
            return ""
        # An occurrence wholly inside text fed before would have been found then.
        start = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            cut = min(found)
            self.hit = True
            self.text = self.text[:cut]
            return self._show(cut)
        if final:
            return self._show(len(self.text))
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        return self._show(len(self.text) - hold)

    def _show(self, end: int) -> str:
        if end <= self.shown:
            return ""
        piece = self.text[self.shown:end]
        self.shown = end
        return piece
