"""What following a streamed reply's text costs the handler at each step, by reply length.

    python -m bench.serving.stream_decode [--tokenizer PATH] [--lengths 128 1024 4096] [--rows 32]

Per push (one token of one reply): the handler's StreamDecoder, against decoding the reply so far in
whole (what it did before it decoded a window), on Meta's Llama 3 tokenizer (128,256 ids; the
one bench.lib.checkpoint writes) over this repository's README as the reply. The last column is what
a step of `--rows` streamed replies of that length spends on it, all on rank 0 between two steps.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from bench.lib.common import OUT, REPO, table
from tp_llama.serving.stream import StreamDecoder
from tp_llama.tokenizer import load_tokenizer


def per_push_ms(make_push: Callable[[], Callable[[int], str]], ids: list[int], last: int, repeats: int = 5) -> float:
    """Mean ms of the pushes of the reply's last `last` tokens, after pushing all before them; the best of
    `repeats` replies, each through a fresh push from make_push()."""
    best = float("inf")
    for _ in range(repeats):
        push = make_push()
        for token in ids[:-last]:
            push(token)
        started = time.perf_counter()
        for token in ids[-last:]:
            push(token)
        best = min(best, (time.perf_counter() - started) / last * 1e3)
    return best


def whole_push(decode: Callable[[list[int]], str]) -> Callable[[int], str]:
    """The reply so far decoded whole at each push."""
    ids: list[int] = []

    def push(token: int) -> str:
        ids.append(token)
        return decode(ids)
    return push


def window_push(decode: Callable[[list[int]], str]) -> Callable[[int], str]:
    """The handler's StreamDecoder."""
    stream = StreamDecoder(decode)
    return lambda token: stream.push([token])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=OUT / "ckpt" / "llama3-d2048-l16-v128256-mp1" / "tokenizer.model")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--rows", type=int, default=32)
    a = parser.parse_args(argv)
    tokenizer = load_tokenizer(a.tokenizer)
    reply = tokenizer.encode((REPO / "README.md").read_text() * 4, bos=False)
    rows = []
    for length in a.lengths:
        ids, last = reply[:length], min(64, length)
        window_ms = per_push_ms(lambda: window_push(tokenizer.decode), ids, last)
        whole_ms = per_push_ms(lambda: whole_push(tokenizer.decode), ids, last)
        rows.append([length, whole_ms, window_ms, whole_ms / window_ms, a.rows * whole_ms, a.rows * window_ms])
    print(table(["reply tokens", "whole ms a push", "window ms a push", "whole / window",
                 f"{a.rows} rows, whole ms a step", f"{a.rows} rows, window ms a step"], rows))


if __name__ == "__main__":
    main()
