"""GGUF's tensor names beside Meta's, and gguf-py (installed by bench/setup_llamacpp.sh), for the
converters both ways (bench/lib/smollm2.py: GGUF -> Meta; bench/lib/meta_gguf.py: Meta -> GGUF)."""

from __future__ import annotations

# Meta's name in a block -> GGUF's, and for the whole model.
META_TO_GGUF_LAYER = {
    "attention_norm": "attn_norm", "attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
    "attention.wo": "attn_output", "ffn_norm": "ffn_norm", "feed_forward.w1": "ffn_gate",
    "feed_forward.w2": "ffn_down", "feed_forward.w3": "ffn_up",
}
META_TO_GGUF_GLOBAL = {"tok_embeddings": "token_embd", "norm": "output_norm", "output": "output"}
GGUF_TO_META_LAYER = {gguf: meta for meta, gguf in META_TO_GGUF_LAYER.items()}
GGUF_TO_META_GLOBAL = {gguf: meta for meta, gguf in META_TO_GGUF_GLOBAL.items()}


def gguf_module():
    try:
        import gguf
    except ImportError:
        raise SystemExit("gguf-py is missing: run `bash bench/setup_llamacpp.sh` (installs the tree's gguf-py)")
    return gguf
