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
    """Feeds token ids in, hands back only the text that is stable.

    Each push decodes a window, not the whole reply (which made a step's cost grow with every reply's
    length): the ids from the start of the last stable piece on, against the same ids up to its end, so
    a tokenizer's context-dependent text at the window's start (SentencePiece's leading space) is the
    same in both and only what follows is new. The window starts where the text was whole characters.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._start = 0  # the window's first id
        self._stable = 0  # ids [_start, _stable) are the last piece handed back
        self._emitted: list[str] = []

    def push(self, ids: list[int]) -> str:
        """Add new ids; return the newly stable text (maybe empty).

        No new ids: "" without decoding. Its text is the window's last piece if a push just handed one back (then
        the two decodes agree), or what the last push held back, unchanged; the native API pushes every
        unfinished choice's ids, often none, on every call."""
        if not ids:
            return ""
        self._ids.extend(ids)
        before = self._decode(self._ids[self._start : self._stable])
        text = self._decode(self._ids[self._start :])
        if text.endswith(REPLACEMENT) or not text.startswith(before) or len(text) == len(before):
            return ""
        self._start, self._stable = self._stable, len(self._ids)
        self._emitted.append(text[len(before) :])
        return self._emitted[-1]

    def finish(self) -> str:
        """Everything not yet emitted, once no more ids will come: the whole reply decoded once."""
        text, emitted = self._decode(self._ids), "".join(self._emitted)
        # Stable text never changes with Llama's tokenizers; if it did, resume where they agree.
        emitted = os.path.commonprefix([text, emitted])
        self._emitted = [text]
        return text[len(emitted) :]


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
