"""The public texts perplexity is scored on, and their token ids exactly as llama.cpp makes them.

    python -m bench.quality.texts [--gguf GGUF] [--texts wiki c4] [--verify]

The texts come from PyPI's `exllamav2` wheel (MIT), conversion/standard_cal_data/: `wiki` (a
Wikipedia sample, 2 MB) and `c4` (web pages from C4, 330 kB), copied to bench/out/quality/NAME.utf8.
Each is tokenized by llama.cpp's llama-tokenize on the GGUF's vocabulary the way llama-perplexity
tokenizes `-f NAME.utf8` (see bench/lib/llamacpp.py: one trailing newline dropped, special tokens as
plain text, BOS only where the vocabulary asks for it), and written to bench/out/quality/NAME.ids
(whitespace-separated) with NAME.ids.json beside it (token count, whether llama.cpp adds a BOS,
the GGUF and a hash of the text). tp_llama.cli.perplexity --ids NAME.ids then scores the very ids
llama-perplexity scores; where llama.cpp adds no BOS (SmolLM2) it takes --no-bos.

--verify runs llama-perplexity on the first two chunks with --kl-divergence-base, whose file
starts with the ids it scored, and checks they are the ones written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import tempfile
import zipfile
from pathlib import Path

from bench.lib import llamacpp
from bench.lib.common import OUT, pip_wheel

HOME = OUT / "quality"
WHEEL = "exllamav2==0.3.2"
SOURCES = {"wiki": "wiki.utf8", "c4": "c4.utf8", "technical": "technical.utf8", "code": "code.utf8"}
DEFAULT_GGUF = OUT / "smollm2" / "plain" / "model-f32.gguf"


def text_path(name: str) -> Path:
    """bench/out/quality/NAME.utf8, unpacked from the exllamav2 wheel the first time."""
    path = HOME / f"{name}.utf8"
    if path.exists():
        return path
    with zipfile.ZipFile(pip_wheel(WHEEL, "exllamav2-*.whl", HOME)) as wheel:
        path.write_bytes(wheel.read(f"exllamav2/conversion/standard_cal_data/{SOURCES[name]}"))
    return path


def add_bos(gguf_path: Path) -> bool:
    """Whether llama.cpp puts a BOS first: the vocabulary's flag, else its default per tokenizer type."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    flag = reader.fields.get("tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag.contents())
    # llama.cpp's defaults when the flag is absent: SentencePiece adds one, the BPE vocabularies not.
    return reader.fields["tokenizer.ggml.model"].contents() == "llama"


def ids_path(name: str) -> Path:
    return HOME / f"{name}.ids"


def write_ids(name: str, gguf_path: Path) -> dict:
    text = text_path(name)
    ids = llamacpp.tokenize(gguf_path, text)
    ids_path(name).write_text(" ".join(map(str, ids)) + "\n")
    info = {
        "text": str(text),
        "text_sha256": hashlib.sha256(text.read_bytes()).hexdigest(),
        "gguf": str(gguf_path),
        "tokens": len(ids),
        "add_bos": add_bos(gguf_path),
        "chunks_512": len(ids) // 512,
    }
    Path(str(ids_path(name)) + ".json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def verify(name: str, gguf_path: Path, ctx: int = 512, chunks: int = 2) -> int:
    """How many of the first chunks*ctx ids differ from what llama-perplexity scored (0 is right)."""
    ids = [int(x) for x in ids_path(name).read_text().split()]
    with tempfile.TemporaryDirectory(dir=HOME) as tmp:
        base = Path(tmp) / "base.kld"
        llamacpp.perplexity(gguf_path, text_path(name), ctx=ctx, chunks=chunks,
                            extra=["--kl-divergence-base", str(base)])
        with open(base, "rb") as f:
            magic = f.read(8)
            n_ctx, n_vocab, n_chunk = struct.unpack("<iIi", f.read(12))
            scored = list(struct.unpack(f"<{n_ctx * n_chunk}i", f.read(4 * n_ctx * n_chunk)))
    if magic != b"_logits_" or n_ctx != ctx:
        raise RuntimeError(f"{base}: not a llama-perplexity logits file of ctx {ctx}")
    return sum(a != b for a, b in zip(scored, ids)) + max(0, len(scored) - len(ids))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="whose vocabulary tokenizes (default: "
                        "SmolLM2's F32 GGUF from bench.lib.smollm2 convert --gguf)")
    parser.add_argument("--texts", nargs="+", choices=sorted(SOURCES), default=["wiki", "c4"])
    parser.add_argument("--verify", action="store_true", help="check the first two chunks against llama-perplexity's")
    args = parser.parse_args(argv)
    for name in args.texts:
        info = write_ids(name, args.gguf)
        line = (f"{name}: {info['tokens']:,} ids ({info['chunks_512']} chunks of 512), llama.cpp adds "
                f"{'a' if info['add_bos'] else 'no'} BOS -> {ids_path(name)}")
        if args.verify:
            wrong = verify(name, args.gguf)
            line += f"; first 2 chunks {'identical to' if not wrong else f'{wrong} ids off from'} llama-perplexity's"
        print(line)


if __name__ == "__main__":
    main()
