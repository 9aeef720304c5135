"""Build small but real tokenizer.model files of both Llama families.

Synthetic test checkpoints need a tokenizer in exactly the on-disk format Meta ships, so the
loader and the serving stack are exercised the same way as with a real download. Both
builders train on the corpus shipped in ``tp_llama/testing/data`` and are deterministic: the same
family and vocabulary size always give the same file bytes.
"""

from __future__ import annotations

import base64
import io
import os
from collections import Counter, defaultdict
from pathlib import Path

import regex
import sentencepiece as spm

from tp_llama.tokenizer import LLAMA3_NUM_SPECIAL, LLAMA3_SPLIT_PATTERN

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"


def build_tokenizer(family: str, out_path: str | os.PathLike, vocab_size: int) -> int:
    """Train a tokenizer of ``family`` ("llama2" or "llama3") and write it to ``out_path``.

    Returns the total vocabulary size (n_words) of the written file, which equals
    ``vocab_size`` for both families.
    """
    text = CORPUS_PATH.read_text(encoding="utf-8")
    if family == "llama2":
        data = _train_sentencepiece(text, vocab_size)
    elif family == "llama3":
        data = _train_byte_bpe(text, vocab_size)
    else:
        raise ValueError(f"unknown tokenizer family {family!r}; expected 'llama2' or 'llama3'")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return vocab_size


def _train_sentencepiece(text: str, vocab_size: int) -> bytes:
    """Train a SentencePiece BPE model with Meta's Llama 1/2 id layout and return its bytes.

    Sentences are passed in memory rather than by file name so the corpus location is not
    recorded in the model, keeping the output identical wherever the package is installed.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    with open(os.devnull, "w") as quiet:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            logstream=quiet,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=0.9995,
            split_digits=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            num_threads=1,
            minloglevel=2,
        )
    return model.getvalue()


def _train_byte_bpe(text: str, vocab_size: int) -> bytes:
    """Train a byte-level BPE with Llama 3 pre-tokenization; return the tiktoken text file.

    The base vocabulary is ``vocab_size`` minus Llama 3's 256 special tokens, which the
    loader appends after it.
    """
    n_base = vocab_size - LLAMA3_NUM_SPECIAL
    if n_base < 256:
        raise ValueError(
            f"llama3 vocab_size must be at least {256 + LLAMA3_NUM_SPECIAL}, got {vocab_size}"
        )
    tokens = [bytes([b]) for b in range(256)] + _learn_merges(text, n_base - 256)
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for rank, tok in enumerate(tokens)]
    return "".join(lines).encode("ascii")


def _learn_merges(text: str, n_new: int) -> list[bytes]:
    """Return ``n_new`` new tokens, learned by repeatedly merging the most frequent pair.

    Pre-tokens are counted once and each distinct one is kept as a list of byte strings.
    Pair counts are updated only for the words a merge touches, which keeps training fast.
    Ties go to the lexicographically smallest pair so the result is deterministic.
    """
    word_counts = Counter(regex.findall(LLAMA3_SPLIT_PATTERN, text))
    distinct = sorted(word_counts)
    words = [[bytes([b]) for b in w.encode("utf-8")] for w in distinct]
    freqs = [word_counts[w] for w in distinct]

    pair_counts: Counter[tuple[bytes, bytes]] = Counter()
    pair_words: defaultdict[tuple[bytes, bytes], set[int]] = defaultdict(set)
    for idx, symbols in enumerate(words):
        for pair in zip(symbols, symbols[1:]):
            pair_counts[pair] += freqs[idx]
            pair_words[pair].add(idx)

    new_tokens: list[bytes] = []
    while len(new_tokens) < n_new:
        best_count = max(pair_counts.values(), default=0)
        if best_count <= 0:
            raise ValueError(f"corpus too small to learn {n_new} merges")
        best = min(pair for pair, count in pair_counts.items() if count == best_count)
        merged = best[0] + best[1]
        new_tokens.append(merged)
        for idx in sorted(pair_words.pop(best)):
            _merge_word(words, idx, best, merged, freqs[idx], pair_counts, pair_words)
        del pair_counts[best]
    return new_tokens


def _merge_word(
    words: list[list[bytes]],
    idx: int,
    pair: tuple[bytes, bytes],
    merged: bytes,
    freq: int,
    pair_counts: Counter[tuple[bytes, bytes]],
    pair_words: defaultdict[tuple[bytes, bytes], set[int]],
) -> None:
    """Replace every occurrence of ``pair`` in word ``idx`` and update the pair statistics."""
    old = words[idx]
    new: list[bytes] = []
    i = 0
    while i < len(old):
        if i + 1 < len(old) and (old[i], old[i + 1]) == pair:
            new.append(merged)
            i += 2
        else:
            new.append(old[i])
            i += 1
    for p in zip(old, old[1:]):
        pair_counts[p] -= freq
    for p in zip(new, new[1:]):
        pair_counts[p] += freq
        pair_words[p].add(idx)
    words[idx] = new
