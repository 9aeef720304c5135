"""Load Meta's tokenizer.model in any of its formats behind one interface.

Llama 1 and 2 ship a binary SentencePiece model; Llama 3.x ships a text file of byte-level BPE
ranks read with tiktoken, and Llama 4 a file of the same kind with its own ranks, pre-tokenizer and
special tokens (llama4_format.py). The file name is the same, so the format is detected from content
(and, between Llama 3 and 4, from the checkpoint's params.json beside it).
The engine and the TorchServe handler only see :class:`Tokenizer`.
"""

from __future__ import annotations

import abc
import base64
import binascii
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tp_llama.llama4_format import (
    LLAMA4_NUM_RANKS,
    LLAMA4_SPECIAL_TOKENS,
    LLAMA4_SPLIT_PATTERN,
    is_llama4_params,
)

if TYPE_CHECKING:
    import sentencepiece as spm

# Llama 3's pre-tokenizer: pieces never cross these matches, and BPE runs inside each piece.
LLAMA3_SPLIT_PATTERN = "|".join(
    [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",  # English contractions
        r"[^\r\n\p{L}\p{N}]?\p{L}+",  # a word, with at most one leading non-letter
        r"\p{N}{1,3}",  # digits, in groups of up to three
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",  # punctuation run, keeping the newlines after it
        r"\s*[\r\n]+",  # whitespace ending in line breaks
        r"\s+(?!\S)",  # whitespace, leaving the last space for the next word
        r"\s+",  # any remaining whitespace
    ]
)

LLAMA3_NUM_SPECIAL = 256
_LLAMA3_NAMED_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_SPECIAL_TOKENS = _LLAMA3_NAMED_SPECIALS + [
    f"<|reserved_special_token_{i}|>"
    for i in range(2, 2 + LLAMA3_NUM_SPECIAL - len(_LLAMA3_NAMED_SPECIALS))
]

CHAT_ROLES = ("system", "user", "assistant")
# Llama 2's turn markers are plain text, so a message holding one would forge a turn or a system
# prompt with the template's own ids; Meta's generation.py refuses such dialogs (its SPECIAL_TAGS).
LLAMA2_CHAT_TAGS = ("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>")

# Long inputs are cut exactly where Meta's reference tokenizers (llama-models, Llama 3's and 4's
# alike) cut them, so the ids match Meta's for any input: the text is taken in slices of 400,000
# characters, cut blindly (tiktoken can fail on longer calls), and inside a slice any run of more
# than 25,000 consecutive whitespace or non-whitespace characters is cut every 25,000 characters
# (BPE on one huge pre-token is slow). Whitespace is ``str.isspace``, which is what ``re``'s ``\s``
# matches (the ``regex`` module's ``\s`` differs on U+001C..U+001F).
LLAMA3_SLICE_CHARS = 400_000
LLAMA3_MAX_RUN_CHARS = 25_000
_RUN = re.compile(r"\s+|\S+")
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} [0-9]+")


class Tokenizer(abc.ABC):
    """Common interface of both tokenizer families.

    ``stop_ids`` are the ids that end a generated reply; ``n_words`` counts every id the
    tokenizer can produce or decode, special tokens included.
    """

    family: str
    n_words: int
    bos_id: int
    eos_id: int
    stop_ids: frozenset[int]

    @abc.abstractmethod
    def _encode_text(self, text: str) -> list[int]:
        """Encode plain text; special-token strings in it stay ordinary text."""

    @abc.abstractmethod
    def _decode_ids(self, ids: list[int]) -> str:
        """Decode ids already checked to be in range."""

    @abc.abstractmethod
    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Apply the family's chat template; the result ends where the assistant replies."""

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Encode ``text``, optionally framed by BOS and EOS."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids = self._encode_text(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def special_names(self) -> dict[int, str]:
        """Id -> name of the tokens the tokenizer adds around text (BOS, EOS, chat markers)."""
        return {}

    @abc.abstractmethod
    def token_bytes(self) -> list[bytes]:
        """Each id's bytes as it adds them to decoded text; control tokens are b"\\xff" + their name,
        the marking grammar engines (llguidance) read as "never part of text"."""

    def decode(self, ids: list[int]) -> str:
        """Decode ``ids``; an id outside the vocabulary is a caller bug, so it raises."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.n_words]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.n_words}): {bad[:5]}")
        return self._decode_ids(ids)


class SentencePieceTokenizer(Tokenizer):
    """Llama 1/2 tokenizer: a SentencePiece model with BOS and EOS as control pieces."""

    family = "llama2"

    def __init__(self, processor: spm.SentencePieceProcessor) -> None:
        self._sp = processor
        self.n_words = processor.vocab_size()
        self.bos_id = processor.bos_id()
        self.eos_id = processor.eos_id()
        self.stop_ids = frozenset({self.eos_id})

    def _encode_text(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def special_names(self) -> dict[int, str]:
        return {i: self._sp.id_to_piece(i) for i in (self.bos_id, self.eos_id) if i >= 0}

    def _decode_ids(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def token_bytes(self) -> list[bytes]:
        sp, pieces = self._sp, []
        for i in range(self.n_words):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):  # byte fallback: <0xAB>
                pieces.append(bytes([int(piece[3:5], 16)]))
            elif sp.is_control(i) or sp.is_unknown(i):
                pieces.append(b"\xff" + piece.encode("utf-8"))
            else:
                pieces.append(piece.replace("\u2581", " ").encode("utf-8"))
        return pieces

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Llama 2 [INST] format: the system prompt joins the first user turn."""
        turns = [(role, "".join(parts)) for role, parts in _validate_messages(messages)]
        for i, (_, content) in enumerate(turns):
            tags = [tag for tag in LLAMA2_CHAT_TAGS if tag in content]
            if tags:
                raise ValueError(f"llama2 chat: message {i} holds {tags[0]!r}, one of the template's markers "
                                 f"{LLAMA2_CHAT_TAGS}, which are refused in messages as Meta's reference does")
        if turns[0][0] == "system":
            if len(turns) < 2:
                raise ValueError("a system message must be followed by a user message")
            system, (role, first) = turns[0][1], turns[1]
            turns = [(role, f"<<SYS>>\n{system}\n<</SYS>>\n\n{first}")] + turns[2:]
        for i, (role, _) in enumerate(turns):
            expected = "user" if i % 2 == 0 else "assistant"
            if role != expected:
                raise ValueError(
                    f"llama2 chat: turn {i} must be {expected!r}, got {role!r}; after an optional "
                    "system message, roles must alternate user/assistant"
                )
        if turns[-1][0] != "user":
            raise ValueError("llama2 chat: the last message must be from the user")
        ids: list[int] = []
        for (_, question), (_, answer) in zip(turns[0::2], turns[1::2]):
            ids += self.encode(f"[INST] {question.strip()} [/INST] {answer.strip()} ", eos=True)
        ids += self.encode(f"[INST] {turns[-1][1].strip()} [/INST]")
        return ids


class TiktokenBase(Tokenizer):
    """What the tiktoken families share: byte-level BPE ranks with the special tokens numbered right
    after them, and chat turns framed by header tokens. A subclass names its family's values."""

    split_pattern: str
    special_tokens: list[str]
    header: tuple[str, str]  # the tokens around a turn's role
    end_of_turn: str
    stop_tokens: tuple[str, ...]
    strip_chat: bool  # whether Meta's ChatFormat strips a message's text before encoding it

    def __init__(self, ranks: dict[bytes, int], name: str) -> None:
        n_base = len(ranks)
        self.special_ids = {tok: n_base + i for i, tok in enumerate(self.special_tokens)}
        import tiktoken  # here, so the engine imports on machines without the tokenizers (checks/gpu_check.py)

        self._enc = tiktoken.Encoding(
            name=name,
            pat_str=self.split_pattern,
            mergeable_ranks=ranks,
            special_tokens=self.special_ids,
        )
        self.n_words = n_base + len(self.special_tokens)
        self.bos_id = self.special_ids["<|begin_of_text|>"]
        self.eos_id = self.special_ids["<|end_of_text|>"]
        self.stop_ids = frozenset(self.special_ids[t] for t in self.stop_tokens)

    def _encode_text(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _llama3_pieces(text):
            ids += self._enc.encode(piece, allowed_special=set(), disallowed_special=())
        return ids

    def _decode_ids(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def token_bytes(self) -> list[bytes]:
        n_base = self.n_words - len(self.special_tokens)
        pieces = [self._enc.decode_single_token_bytes(i) for i in range(n_base)]
        return pieces + [b"\xff" + name.encode("ascii") for name in self.special_tokens]

    def special_names(self) -> dict[int, str]:
        return {i: name for name, i in self.special_ids.items()}

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The family's header format, ending with an open assistant header."""
        ids = [self.bos_id]
        for role, parts in _validate_messages(messages):
            ids += self._header(role)
            for part in parts:  # each text part on its own, as ChatFormat encodes a list of RawTextItems
                ids += self.encode(part.strip() if self.strip_chat else part, bos=False)
            ids.append(self.special_ids[self.end_of_turn])
        ids += self._header("assistant")
        return ids

    def _header(self, role: str) -> list[int]:
        start, end = self.header
        return (
            [self.special_ids[start]]
            + self.encode(role, bos=False)
            + [self.special_ids[end]]
            + self.encode("\n\n", bos=False)
        )


class TiktokenTokenizer(TiktokenBase):
    """Llama 3.x tokenizer: byte-level BPE ranks plus 256 special tokens appended after them."""

    family = "llama3"
    split_pattern = LLAMA3_SPLIT_PATTERN
    special_tokens = LLAMA3_SPECIAL_TOKENS
    header = ("<|start_header_id|>", "<|end_header_id|>")
    end_of_turn = "<|eot_id|>"
    stop_tokens = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    strip_chat = True


class Llama4Tokenizer(TiktokenBase):
    """Llama 4 tokenizer: o200k's pre-tokenizer, 2,048 special tokens after the ranks, turns in
    ``<|header_start|>`` headers ending ``<|eot|>``, each message's text encoded as sent."""

    family = "llama4"
    split_pattern = LLAMA4_SPLIT_PATTERN
    special_tokens = LLAMA4_SPECIAL_TOKENS
    header = ("<|header_start|>", "<|header_end|>")
    end_of_turn = "<|eot|>"
    stop_tokens = ("<|eot|>", "<|eom|>", "<|end_of_text|>")
    strip_chat = False


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load ``path`` as a tiktoken BPE file or a SentencePiece model, whichever it is.

    A tiktoken file does not name its family, and Llama 3 and 4 number different special tokens
    after the ranks: it is Llama 4's when it has Llama 4's 200,000 ranks or when the checkpoint's
    params.json beside it is Llama 4's (a smaller vocabulary, as test checkpoints have), else Llama 3's.
    """
    path = Path(path)
    data = path.read_bytes()
    if _looks_like_tiktoken(data):
        ranks = _parse_tiktoken_ranks(data, path)
        llama4 = len(ranks) == LLAMA4_NUM_RANKS or _llama4_params_beside(path)
        return (Llama4Tokenizer if llama4 else TiktokenTokenizer)(ranks, name=path.name)
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(data)
    except (RuntimeError, OSError) as err:
        raise ValueError(f"{path}: neither a SentencePiece model nor a tiktoken BPE file") from err
    if processor.vocab_size() == 0:
        raise ValueError(f"{path}: SentencePiece model with an empty vocabulary")
    return SentencePieceTokenizer(processor)


def _llama4_params_beside(path: Path) -> bool:
    """Whether the params.json next to ``path`` is a Llama 4 one; a missing or unreadable one is not
    (reading params.json reports its own errors)."""
    try:
        return is_llama4_params(json.loads((path.parent / "params.json").read_text()))
    except (OSError, ValueError):
        return False


def _looks_like_tiktoken(data: bytes) -> bool:
    """True when every line is "<base64> <rank>", the Llama 3 and 4 tokenizer.model layout."""
    lines = data.splitlines()
    return bool(lines) and all(_TIKTOKEN_LINE.fullmatch(line) for line in lines)


def _parse_tiktoken_ranks(data: bytes, path: Path) -> dict[bytes, int]:
    """Read the ranks of a tiktoken file, checking what byte-level BPE relies on.

    Every single byte must be a token so any text can be encoded, and ranks must be exactly
    0..N-1 because Llama 3 and 4 place their special tokens right after them.
    """
    lines = data.splitlines()
    ranks: dict[bytes, int] = {}
    for line in lines:
        token, rank = line.split(b" ")
        try:
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except binascii.Error as err:
            raise ValueError(f"{path}: bad base64 token {token!r}") from err
    if len(ranks) != len(lines) or sorted(ranks.values()) != list(range(len(lines))):
        raise ValueError(f"{path}: tiktoken ranks are not unique tokens numbered 0..N-1")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: tiktoken file lacks {len(missing)} of the 256 byte tokens")
    return ranks


def _llama3_pieces(
    text: str, slice_chars: int = LLAMA3_SLICE_CHARS, max_run: int = LLAMA3_MAX_RUN_CHARS
) -> Iterator[str]:
    """Cut ``text`` into the pieces that are encoded separately, by Meta's rule.

    Slices of ``slice_chars`` characters; within a slice, a whitespace or non-whitespace run
    longer than ``max_run`` is cut after every ``max_run`` of its characters. Run counting
    restarts at each slice. Pieces are non-empty; an empty text has none.
    """
    for base in range(0, len(text), slice_chars):
        chunk = text[base : base + slice_chars]
        start = 0
        for run in _RUN.finditer(chunk):
            for cut in range(run.start() + max_run, run.end(), max_run):
                yield chunk[start:cut]
                start = cut
        yield chunk[start:]


def _validate_messages(messages: list[dict]) -> list[tuple[str, tuple[str, ...]]]:
    """Check the common shape of a chat and return it as (role, text parts) pairs.

    A content is a str, or a tuple of str: the OpenAI API's text parts (a tuple, which no JSON body
    can send, so the native API stays str-only). Meta's ChatFormat encodes each part on its own, so
    BPE never merges across two parts; a str is one part.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"message {i}: role must be one of {CHAT_ROLES}, got {role!r}")
        parts = content if isinstance(content, tuple) else (content,)
        if not all(isinstance(part, str) for part in parts):
            raise ValueError(
                f"message {i}: content must be a str, got {type(content).__name__}"
            )
        turns.append((role, parts))
    return turns
