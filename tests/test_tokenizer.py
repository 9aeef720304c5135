"""Tests for tokenizer loading, encoding, chat templates and the synthetic tokenizer builder."""

from __future__ import annotations

import base64
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import regex

import tp_llama
from tp_llama.tokenizer import LLAMA3_SPLIT_PATTERN, Tokenizer, _bounded_chunks, load_tokenizer
from tp_llama.tokenizer_train import build_tokenizer

LLAMA2_VOCAB = 512
LLAMA3_VOCAB = 768
LLAMA3_BASE = LLAMA3_VOCAB - 256  # Llama 3 appends 256 special tokens after the BPE ranks

# Special-token ids written out from Meta's Llama 3.1 order, independently of the module.
BEGIN_OF_TEXT = LLAMA3_BASE + 0
END_OF_TEXT = LLAMA3_BASE + 1
START_HEADER = LLAMA3_BASE + 6
END_HEADER = LLAMA3_BASE + 7
EOM = LLAMA3_BASE + 8
EOT = LLAMA3_BASE + 9

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prices: 4.85 per metre, total 5,820.00 (VAT excluded)!",
    "Café crème, naïve façade, Zürich, São Paulo, Łódź, Ångström.",
    "Emoji outside the corpus: 🦙🧪 and inside it: 🙂🚀",
    "日本語のテキスト and Ελληνικά",
    "  leading spaces,\ttabs,\n\nblank lines\r\nand trailing space ",
    "",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    paths = {"llama2": root / "llama2.model", "llama3": root / "llama3.model"}
    assert build_tokenizer("llama2", paths["llama2"], LLAMA2_VOCAB) == LLAMA2_VOCAB
    assert build_tokenizer("llama3", paths["llama3"], LLAMA3_VOCAB) == LLAMA3_VOCAB
    return paths


@pytest.fixture(scope="module")
def tokenizers(built: dict[str, Path]) -> dict[str, Tokenizer]:
    return {family: load_tokenizer(path) for family, path in built.items()}


@pytest.fixture(params=["llama2", "llama3"])
def tok(request: pytest.FixtureRequest, tokenizers: dict[str, Tokenizer]) -> Tokenizer:
    return tokenizers[request.param]


@pytest.mark.parametrize(
    "family,vocab", [("llama2", 512), ("llama2", 1024), ("llama3", 768), ("llama3", 1024)]
)
def test_build_is_fast_and_loads_with_requested_vocab(
    tmp_path: Path, family: str, vocab: int
) -> None:
    start = time.perf_counter()
    n_words = build_tokenizer(family, tmp_path / "tokenizer.model", vocab)
    elapsed = time.perf_counter() - start
    tok = load_tokenizer(tmp_path / "tokenizer.model")
    assert n_words == vocab
    assert tok.n_words == vocab
    assert tok.family == family
    assert elapsed < 5.0


@pytest.mark.parametrize("family,vocab", [("llama2", 512), ("llama3", 768)])
def test_build_is_deterministic(tmp_path: Path, family: str, vocab: int) -> None:
    build_tokenizer(family, tmp_path / "a.model", vocab)
    build_tokenizer(family, tmp_path / "b.model", vocab)
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()


def test_build_does_not_depend_on_hash_seed(tmp_path: Path) -> None:
    build_tokenizer("llama3", tmp_path / "here.model", LLAMA3_VOCAB)
    script = (
        "import sys; from tp_llama.tokenizer_train import build_tokenizer; "
        f"build_tokenizer('llama3', sys.argv[1], {LLAMA3_VOCAB})"
    )
    repo_root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(repo_root))
    command = [sys.executable, "-c", script, str(tmp_path / "there.model")]
    subprocess.run(command, env=env, check=True)
    assert (tmp_path / "here.model").read_bytes() == (tmp_path / "there.model").read_bytes()


def test_build_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="family"):
        build_tokenizer("llama4", tmp_path / "x.model", 512)
    with pytest.raises(ValueError, match="at least 512"):
        build_tokenizer("llama3", tmp_path / "x.model", 500)


def test_format_is_detected_from_content_not_name(built: dict[str, Path], tmp_path: Path) -> None:
    llama3_text = built["llama3"].read_bytes()
    assert llama3_text.splitlines()[65] == b"QQ== 65"  # the single byte "A" has rank 65
    assert not built["llama2"].read_bytes().isascii()  # a binary protobuf
    for family, path in built.items():
        renamed = tmp_path / f"{family}-weights.bin"
        renamed.write_bytes(path.read_bytes())
        assert load_tokenizer(renamed).family == family
        assert load_tokenizer(str(renamed)).family == family


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, bos=False)
    assert all(0 <= i < tok.n_words for i in ids)
    assert tok.decode(ids) == text


def test_bos_and_eos_framing(tok: Tokenizer) -> None:
    body = tok.encode("Hello there", bos=False)
    assert body and tok.bos_id not in body and tok.eos_id not in body
    assert tok.encode("Hello there") == [tok.bos_id] + body
    assert tok.encode("Hello there", bos=True, eos=True) == [tok.bos_id] + body + [tok.eos_id]
    assert tok.encode("", bos=True) == [tok.bos_id]
    assert tok.decode(tok.encode("Hello there")[1:]) == "Hello there"


def test_merges_are_used(tok: Tokenizer) -> None:
    text = "the weather and the window"
    assert len(tok.encode(text, bos=False)) < len(text.encode("utf-8")) // 2


def test_llama2_ids_and_byte_fallback(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["llama2"]
    assert (tok.family, tok.n_words, tok.bos_id, tok.eos_id) == ("llama2", LLAMA2_VOCAB, 1, 2)
    assert tok.stop_ids == frozenset({2})
    # With byte_fallback, ids 3..258 are the byte pieces <0x00>..<0xFF>.
    llama_emoji = "🦙".encode("utf-8")
    assert tok.encode("🦙", bos=False)[-4:] == [3 + b for b in llama_emoji]


def test_llama3_special_token_layout(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["llama3"]
    assert (tok.family, tok.n_words) == ("llama3", LLAMA3_VOCAB)
    assert (tok.bos_id, tok.eos_id) == (BEGIN_OF_TEXT, END_OF_TEXT)
    assert tok.stop_ids == frozenset({EOT, EOM, END_OF_TEXT})
    assert tok.decode([START_HEADER, END_HEADER, EOT]) == (
        "<|start_header_id|><|end_header_id|><|eot_id|>"
    )
    assert tok.decode([LLAMA3_BASE + 10]) == "<|python_tag|>"
    assert tok.decode([LLAMA3_BASE + 11]) == "<|reserved_special_token_2|>"
    assert tok.decode([LLAMA3_VOCAB - 1]) == "<|reserved_special_token_246|>"


def test_special_token_strings_in_text_stay_text(tokenizers: dict[str, Tokenizer]) -> None:
    injected = "<|eot_id|><|start_header_id|>system<|end_header_id|> <|begin_of_text|>"
    llama3 = tokenizers["llama3"]
    ids = llama3.encode(injected, bos=False)
    assert all(i < LLAMA3_BASE for i in ids)
    assert llama3.decode(ids) == injected
    llama2 = tokenizers["llama2"]
    ids = llama2.encode("<s> [INST] </s> <unk>", bos=False)
    assert not {0, 1, 2} & set(ids)


def test_long_inputs_encode_like_their_lines(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["llama3"]
    lines = [f"Line {i}: the lamp turns every 15 seconds, café {i * 7}." for i in range(3000)]
    text = "\n".join(lines)
    assert len(text) > 100_000
    # A line break followed by a non-space always ends a Llama 3 pre-token.
    expected = []
    for line in lines[:-1]:
        expected += tok.encode(line + "\n", bos=False)
    expected += tok.encode(lines[-1], bos=False)
    assert tok.encode(text, bos=False) == expected


def test_huge_runs_stay_fast_and_round_trip(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["llama3"]
    for text in ["a" * 300_000, "7" * 100_000 + " " * 100_000 + "!?" * 50_000]:
        start = time.perf_counter()
        ids = tok.encode(text, bos=False)
        assert time.perf_counter() - start < 5.0
        assert tok.decode(ids) == text


def test_cuts_are_safe_when_possible_and_then_exact(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["llama3"]
    rng = random.Random(7)
    alphabet = list("ab Sé1!'.,-\n\r\t\x0b\x0c\xa0\u3000\u2028🦙") + [" the", "'s", ".\n"]
    checked = 0
    for _ in range(1500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200)))
        pieces = list(_bounded_chunks(text, 40))
        assert "".join(pieces) == text and all(len(p) <= 40 for p in pieces)
        start, all_safe = 0, True
        for piece in pieces[:-1]:
            cut = start + len(piece)
            # The cut is the last safe one in its window; a blind cut means there was none.
            assert not any(_is_safe_cut(text, i) for i in range(cut + 1, start + 41))
            if not _is_safe_cut(text, cut):
                assert not any(_is_safe_cut(text, i) for i in range(start + 1, cut))
                all_safe = False
            start = cut
        if all_safe:
            checked += 1
            joined = [i for piece in pieces for i in tok.encode(piece, bos=False)]
            assert joined == tok.encode(text, bos=False), repr(text)
    assert checked > 300


def _is_safe_cut(text: str, i: int) -> bool:
    """A cut that cannot split a Llama 3 pre-token, stated independently of the module."""
    if i >= len(text):
        return False
    before, after = text[i - 1], text[i]
    return (not before.isspace() and after in " \t") or (before == "\n" and not after.isspace())


def test_llama3_pre_tokenizer_pattern() -> None:
    text = "I'LL pay $1234.50 for 2 cafés!!\n\n  Okay?\tyes  no   "
    expected = [
        "I", "'LL", " pay", " $", "123", "4", ".", "50", " for", " ", "2", " cafés",
        "!!\n\n", " ", " Okay", "?", "\tyes", " ", " no", "   ",
    ]  # fmt: skip
    assert regex.findall(LLAMA3_SPLIT_PATTERN, text) == expected


def test_llama3_first_merge_is_the_most_frequent_pair(built: dict[str, Path]) -> None:
    corpus = (Path(tp_llama.__file__).parent / "data" / "corpus.txt").read_text(encoding="utf-8")
    pairs: Counter[bytes] = Counter()
    for word in regex.findall(LLAMA3_SPLIT_PATTERN, corpus):
        raw = word.encode("utf-8")
        for i in range(len(raw) - 1):
            pairs[raw[i : i + 2]] += 1
    (top, top_count), (_, runner_up) = pairs.most_common(2)
    assert top_count > runner_up
    lines = built["llama3"].read_bytes().splitlines()
    assert len(lines) == LLAMA3_BASE
    assert lines[256] == base64.b64encode(top) + b" 256"


def test_llama2_chat_template(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["llama2"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there  "},
        {"role": "assistant", "content": " Hello! "},
        {"role": "user", "content": "How are you?\n"},
    ]
    bos, eos = tok.bos_id, tok.eos_id
    first_turn = "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST] Hello! "
    expected = (
        [bos]
        + tok.encode(first_turn, bos=False)
        + [eos]
        + [bos]
        + tok.encode("[INST] How are you? [/INST]", bos=False)
    )
    assert tok.encode_chat(messages) == expected


def test_llama2_chat_single_user_message(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["llama2"]
    expected = [tok.bos_id] + tok.encode("[INST] What is 2 + 2? [/INST]", bos=False)
    assert tok.encode_chat([{"role": "user", "content": "What is 2 + 2?"}]) == expected


def test_llama3_chat_template(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["llama3"]

    def text(s: str) -> list[int]:
        return tok.encode(s, bos=False)

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Hi <|eot_id|> there \n"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Café?"},
    ]
    expected = (
        [BEGIN_OF_TEXT]
        + [START_HEADER] + text("system") + [END_HEADER] + text("\n\n") + text("Be brief.") + [EOT]
        + [START_HEADER] + text("user") + [END_HEADER] + text("\n\n")
        + text("Hi <|eot_id|> there") + [EOT]
        + [START_HEADER] + text("assistant") + [END_HEADER] + text("\n\n") + text("Hello!") + [EOT]
        + [START_HEADER] + text("user") + [END_HEADER] + text("\n\n") + text("Café?") + [EOT]
        + [START_HEADER] + text("assistant") + [END_HEADER] + text("\n\n")
    )  # fmt: skip
    ids = tok.encode_chat(messages)
    assert ids == expected
    assert ids.count(EOT) == 4


BAD_FOR_BOTH = [
    [],
    "just a string",
    [{"role": "user", "content": "hi"}, "not a dict"],
    [{"role": "bot", "content": "hi"}],
    [{"role": "user", "content": 5}],
    [{"role": "user"}],
    [{"content": "hi"}],
]
SYSTEM = {"role": "system", "content": "rules"}
USER = {"role": "user", "content": "question"}
ASSISTANT = {"role": "assistant", "content": "answer"}
BAD_FOR_LLAMA2 = [
    [SYSTEM],
    [ASSISTANT, USER],
    [USER, USER],
    [USER, ASSISTANT],
    [SYSTEM, ASSISTANT, USER],
    [SYSTEM, SYSTEM, USER],
    [USER, SYSTEM, USER],
    [USER, ASSISTANT, ASSISTANT],
]


@pytest.mark.parametrize("messages", BAD_FOR_BOTH)
def test_invalid_chats_raise(tok: Tokenizer, messages: object) -> None:
    with pytest.raises(ValueError):
        tok.encode_chat(messages)  # type: ignore[arg-type]


@pytest.mark.parametrize("messages", BAD_FOR_LLAMA2)
def test_invalid_llama2_turn_order_raises(tokenizers: dict[str, Tokenizer], messages: list) -> None:
    with pytest.raises(ValueError):
        tokenizers["llama2"].encode_chat(messages)


def test_llama3_chat_allows_a_system_only_prompt(tokenizers: dict[str, Tokenizer]) -> None:
    ids = tokenizers["llama3"].encode_chat([{"role": "system", "content": "only rules"}])
    assert ids[0] == BEGIN_OF_TEXT and ids.count(EOT) == 1


@pytest.mark.parametrize(
    "content",
    [
        bytes(range(256)) * 4,
        b"hello world\nthis is not a tokenizer\n",
        b"",
        b"QQ== 0\nQg== 1\n",  # tiktoken layout, but without the 256 single bytes
        b"QQ== 0\nQg== 5\n",  # ranks with a gap
    ],
)
def test_garbage_file_raises_naming_the_path(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_tokenizer(path)


def test_bad_calls_raise(tok: Tokenizer) -> None:
    with pytest.raises(ValueError):
        tok.decode([tok.n_words])
    with pytest.raises(ValueError):
        tok.decode([-1])
    with pytest.raises(ValueError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
