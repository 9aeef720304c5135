"""OpenAI's log-probability objects: chat's `content` list and the legacy completions' four lists.

Completions answer `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per
token: its text, its log-probability, a {token text: log-probability} dict of the most likely
tokens, and where its text starts. With `echo` the prompt's tokens come first, the first of them
with null for its log-probability and its dict (nothing predicts it), as OpenAI's legacy models and
vLLM answer and lm-evaluation-harness reads. Offsets run over the tokens' texts, prompt then
completion, across the chunks of a streamed reply.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tp_llama.engine.sampling import TokenLogprobs

Decode = Callable[[list[int]], str]
RawBytes = Callable[[int], bytes]


@functools.lru_cache(maxsize=4)
def _byte_table(tokenizer: Any) -> tuple[bytes, ...]:
    return tuple(tokenizer.token_bytes())


def raw_token_bytes(tokenizer: Any) -> RawBytes | None:
    """Each id's own bytes (its table built once, at the first use), where the tokenizer can say them."""
    if not hasattr(tokenizer, "token_bytes"):
        return None
    return lambda token: _byte_table(tokenizer)[token]


def chat_logprobs(entries: list[TokenLogprobs], decode: Decode, raw: RawBytes | None = None) -> dict[str, Any]:
    """Chat's logprobs object: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}; a token that
    holds part of a character (its text U+FFFD) gives its own bytes, which OpenAI's `bytes` are for."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = decode([token])
        # Only text tokens decode to U+FFFD (control tokens give their names), so their table entry is their bytes.
        data = raw(token) if raw is not None and "\ufffd" in text else text.encode("utf-8")
        return {"token": text, "logprob": logprob, "bytes": list(data)}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(*top) for top in t.top]}
                        for t in entries]}


class LegacyLogprobs:
    """One choice's completions logprobs, chunk after chunk (the offsets go on where the last chunk ended)."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.offset = 0

    def _lists(self, tokens: list[int], logprobs: list[float | None], tops: list[dict[str, float] | None]
               ) -> dict[str, Any]:
        texts = [self.decode([token]) for token in tokens]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _top(self, entry: TokenLogprobs) -> dict[str, float]:
        """{text: log-probability} of the most likely tokens; tokens of equal text (lone bytes all decode to
        U+FFFD) share a key, which keeps the best of them (the list is best first): a later one's lower value
        would make the text look less likely than it is, and another text the dict's best."""
        top: dict[str, float] = {}
        for token, value in entry.top:
            top.setdefault(self.decode([token]), value)
        return top

    def generated(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        """The lists of generated tokens."""
        return self._lists([t.token for t in entries], [t.logprob for t in entries], [self._top(t) for t in entries])

    def prompt(self, prompt_ids: list[int], entries: list[TokenLogprobs]) -> dict[str, Any]:
        """The lists of an echoed prompt: its first token null, then entries[i] for token i + 1."""
        return self._lists(prompt_ids, [None] + [t.logprob for t in entries], [None] + [self._top(t) for t in entries])


def joined(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two runs of the four lists as one (the first may be missing)."""
    return second if first is None else {key: first[key] + second[key] for key in first}
