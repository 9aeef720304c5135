"""A Meta-layout MP 1 checkpoint written as an F32 GGUF for llama.cpp, with gguf-py directly.

    python -m bench.lib.meta_gguf CKPT_DIR OUT.gguf

What llama.cpp's own route (Meta -> Hugging Face -> convert_hf_to_gguf.py) would produce for a
Llama 3.x model, without the Hugging Face folder in between:

- Metadata of the "llama" architecture: block count, embedding and FFN widths, heads and KV heads
  (GQA), RMSNorm epsilon, rope base and rotated dimensions, vocabulary size, and a context length of
  131,072 when params.json sets use_scaled_rope (Llama 3.1 / 3.2), else 8,192.
- Meta's use_scaled_rope: llama.cpp has no rope-scaling key for Llama 3's frequency stretch; its
  converter writes a `rope_freqs` tensor of head_dim/2 factors by which ggml's rope divides each
  pair's frequency (1 for fast pairs, the factor for slow ones, a blend between), computed with the
  fixed constants tp_llama's rope_frequencies uses (factor 8, low 1, high 4, 8,192 positions).
- q/k rows: Meta rotates adjacent pairs; transformers halves of each head; Meta -> HF permutes the
  rows (bench/lib/hf_convert.py's to_hf_rotary), and llama.cpp's converter permutes HF's rows back
  into pairs, the order its LLAMA graph rotates in. Both are applied here, so what is written is what
  llama.cpp's route writes (the two undo each other: the rows end up in Meta's order).
- Every matrix and the embedding in float32, norms and rope_freqs in float32 (llama-quantize turns
  the 2-D ones into BF16 / Q8_0 / Q4_0 / Q4_K_M; it leaves 1-D tensors alone).
- The tokenizer: tp_llama's tokenizer.model is a tiktoken file (base64 token, rank) to which Llama 3
  appends 256 special tokens. It becomes the GPT-2 BPE vocabulary convert_hf_to_gguf writes for Llama 3
  ("gpt2" model, "llama-bpe" pre-tokenizer): each rank's bytes in GPT-2's byte-to-character alphabet,
  the specials as CONTROL tokens, ids past the tokenizer up to the model's vocabulary as UNUSED
  padding, and merges by pairing: every split of a token into two tokens, both of lower rank, is a
  merge, ordered by the merged token's rank (how Llama 3's Hugging Face tokenizer.json was derived).
  With Meta's tokenizer.model llama.cpp then tokenizes text as tp_llama does (`check-tokens` shows it).

Tensors are read from the memory-mapped shard and written one at a time, so a conversion holds
about one float32 tensor beyond the mapped checkpoint.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

from bench.lib.gguf_names import META_TO_GGUF_LAYER, gguf_module
from bench.lib.hf_convert import to_hf_rotary
from tp_llama.checkpoint.params import read_params
from tp_llama.checkpoint.shards import find_shards, load_shard
from tp_llama.model import ModelArgs
from tp_llama.tokenizer import LLAMA3_SPECIAL_TOKENS, TiktokenTokenizer, load_tokenizer

# Bumped whenever what this module writes changes, so cached GGUFs made by an older one are redone.
FORMAT = 1
# Llama 3.1's rope stretch, as tp_llama/model/llama.py's rope_frequencies applies it.
LOW_FREQ_FACTOR, OLD_CONTEXT = 1.0, 8192.0

def to_gguf_rotary(hf_weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter on a Hugging Face q/k weight: each head's rows from [2, pair] to [pair, 2]."""
    rows = hf_weight.shape[0]
    return hf_weight.reshape(n_heads, 2, rows // n_heads // 2, *hf_weight.shape[1:]).swapaxes(1, 2).reshape(
        hf_weight.shape)


def rope_factors(args: ModelArgs) -> np.ndarray:
    """Per rotated pair, the divisor of its frequency that makes llama.cpp's rope Llama 3.1's scaled one."""
    out, (factor, high) = [], args.rope_scaling
    for i in range(0, args.head_dim, 2):
        wavelen = 2 * math.pi * args.rope_theta ** (i / args.head_dim)
        if wavelen < OLD_CONTEXT / high:
            out.append(1.0)
        elif wavelen > OLD_CONTEXT / LOW_FREQ_FACTOR:
            out.append(factor)
        else:
            smooth = (OLD_CONTEXT / wavelen - LOW_FREQ_FACTOR) / (high - LOW_FREQ_FACTOR)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gpt2_chars() -> list[str]:
    """GPT-2's byte-level alphabet, byte -> character: printable Latin-1 bytes stand for themselves,
    the other 68 for U+0100 onwards in byte order (so no token holds a space or a control byte)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tiktoken_ranks(path: Path) -> list[bytes]:
    """The file's tokens in rank order (tp_llama's loader has checked ranks are 0..N-1)."""
    ranks: dict[int, bytes] = {}
    for line in path.read_bytes().splitlines():
        token, rank = line.split(b" ")
        ranks[int(rank)] = base64.b64decode(token)
    return [ranks[r] for r in range(len(ranks))]


def bpe_vocab(tokenizer_path: Path, vocab_size: int) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """(tokens, token types, merges, special ids) of the GPT-2 BPE vocabulary for a Llama 3 tiktoken file."""
    gguf = gguf_module()
    tokenizer = load_tokenizer(tokenizer_path)
    if not isinstance(tokenizer, TiktokenTokenizer):
        raise SystemExit(f"{tokenizer_path}: only Llama 3's tiktoken tokenizer is converted "
                         f"(got {type(tokenizer).__name__})")
    ranked = tiktoken_ranks(tokenizer_path)
    if tokenizer.n_words > vocab_size:
        raise SystemExit(f"the tokenizer has {tokenizer.n_words} ids, the model {vocab_size} rows")
    alphabet = gpt2_chars()
    text = ["".join(alphabet[b] for b in tok) for tok in ranked]
    tokens = text + list(LLAMA3_SPECIAL_TOKENS)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types = ([gguf.TokenType.NORMAL] * len(ranked) + [gguf.TokenType.CONTROL] * len(LLAMA3_SPECIAL_TOKENS)
             + [gguf.TokenType.UNUSED] * (vocab_size - tokenizer.n_words))
    rank_of = {tok: r for r, tok in enumerate(ranked)}
    merges: list[tuple[int, int, int]] = []
    for r, tok in enumerate(ranked):
        for cut in range(1, len(tok)):
            left, right = rank_of.get(tok[:cut]), rank_of.get(tok[cut:])
            if left is not None and right is not None and left < r and right < r:
                merges.append((r, left, right))
    merges.sort()
    specials = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id}
    return tokens, [int(t) for t in types], [f"{text[a]} {text[b]}" for _, a, b in merges], specials


def gguf_tensors(state: dict[str, torch.Tensor], args: ModelArgs):
    """(GGUF name, float32 array) in the order convert_hf_to_gguf writes them, made one at a time."""
    if args.use_scaled_rope:
        yield "rope_freqs.weight", rope_factors(args)
    yield "token_embd.weight", state["tok_embeddings.weight"]
    for i in range(args.n_layers):
        for meta, name in META_TO_GGUF_LAYER.items():
            weight = state[f"layers.{i}.{meta}.weight"]
            heads = {"attention.wq": args.n_heads, "attention.wk": args.n_kv_heads}.get(meta)
            if heads:
                weight = to_gguf_rotary(to_hf_rotary(weight, heads), heads)
            yield f"blk.{i}.{name}.weight", weight
    yield "output_norm.weight", state["norm.weight"]
    yield "output.weight", state["output.weight"]


def as_f32(value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    return np.ascontiguousarray(value.to(torch.float32).numpy())


def write_gguf(ckpt: Path, path: Path, name: str | None = None) -> Path:
    """Write `path` (an F32 GGUF of the MP 1 checkpoint `ckpt`); returns it."""
    gguf = gguf_module()
    shards = find_shards(ckpt)
    if len(shards) != 1:
        raise SystemExit(f"{ckpt}: the conversion reads an MP 1 checkpoint, found {len(shards)} shards")
    args = read_params(ckpt, load_tokenizer(ckpt / "tokenizer.model").n_words)
    tokens, types, merges, specials = bpe_vocab(ckpt / "tokenizer.model", args.vocab_size)
    state = load_shard(shards[0])

    part = path.with_name(path.name + ".part")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(part), arch="llama")
    writer.add_name(name or ckpt.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(args.n_layers)
    writer.add_context_length(131072 if args.use_scaled_rope else 8192)
    writer.add_embedding_length(args.dim)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_vocab_size(args.vocab_size)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(specials["bos"])
    writer.add_eos_token_id(specials["eos"])
    writer.add_add_bos_token(True)
    # Tensor infos first (shapes only), then each tensor's data as it is made: gguf-py's add_tensor
    # would hold every tensor until the end.
    for key, value in gguf_tensors(state, args):
        shape = tuple(value.shape)
        writer.add_tensor_info(key, shape, np.dtype(np.float32), 4 * math.prod(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, value in gguf_tensors(state, args):
        writer.write_tensor_data(as_f32(value))
    writer.close()
    os.replace(part, path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", type=Path, help="Meta-layout MP 1 checkpoint folder")
    parser.add_argument("out", type=Path, help="the F32 GGUF to write")
    a = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    print(json.dumps({"gguf": str(write_gguf(a.ckpt, a.out))}))


if __name__ == "__main__":
    sys.exit(main())
