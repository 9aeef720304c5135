"""Meta-layout Llama weights as a Hugging Face LlamaForCausalLM: names, rotary row order, config; and
Meta's Llama 3 tokenizer.model as a Hugging Face fast tokenizer.

Used by the transformers baseline (bench/engine/generate.py) and by the vLLM peer
(bench/serving/vllm_peer.py), which writes the result as a Hugging Face folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tp_llama.model import ModelArgs

if TYPE_CHECKING:  # transformers is a bench-only dependency, imported where it is used
    from transformers import LlamaConfig


def hf_config(args: ModelArgs, max_len: int) -> LlamaConfig:
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.use_scaled_rope:
        rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, "factor": args.rope_scaling[0],
                "low_freq_factor": 1.0, "high_freq_factor": args.rope_scaling[1], "original_max_position_embeddings": 8192}
    return LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=max_len, rms_norm_eps=args.norm_eps, rope_parameters=rope,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0, dtype=torch.float32,
    )


def to_hf_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta rotates adjacent pairs (2i, 2i+1); transformers rotates (i, i + head_dim/2) of each head.

    Reordering each head's output rows from [pair, 2] to [2, pair] makes the two the same model.
    """
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def meta_to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Meta names and rotary layout -> LlamaForCausalLM's, in float32."""
    hf = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"],
        "model.norm.weight": state["norm.weight"],
        "lm_head.weight": state["output.weight"],
    }
    for i in range(args.n_layers):
        meta, ours = f"layers.{i}.", f"model.layers.{i}."
        hf[ours + "self_attn.q_proj.weight"] = to_hf_rotary(state[meta + "attention.wq.weight"], args.n_heads)
        hf[ours + "self_attn.k_proj.weight"] = to_hf_rotary(state[meta + "attention.wk.weight"], args.n_kv_heads)
        hf[ours + "self_attn.v_proj.weight"] = state[meta + "attention.wv.weight"]
        hf[ours + "self_attn.o_proj.weight"] = state[meta + "attention.wo.weight"]
        hf[ours + "mlp.gate_proj.weight"] = state[meta + "feed_forward.w1.weight"]
        hf[ours + "mlp.down_proj.weight"] = state[meta + "feed_forward.w2.weight"]
        hf[ours + "mlp.up_proj.weight"] = state[meta + "feed_forward.w3.weight"]
        hf[ours + "input_layernorm.weight"] = state[meta + "attention_norm.weight"]
        hf[ours + "post_attention_layernorm.weight"] = state[meta + "ffn_norm.weight"]
    return {k: v.float().contiguous() for k, v in hf.items()}


def write_llama3_tokenizer(tokenizer_model: Path, out: Path) -> Path:
    """tokenizer.json and tokenizer_config.json for Meta's Llama 3 tokenizer.model, for a server that
    must tokenize itself (vLLM compiles structured outputs over its own tokenizer).

    transformers' tiktoken converter with our split pattern and special tokens (ids from 128,000 in
    Meta's order); like Meta's own Hugging Face files, encoding prepends <|begin_of_text|>, so a
    prompt's ids match the handler's (bos=True). clean_up_tokenization_spaces is off: its rewrites
    (" ," -> ",") would change a reply's bytes, and a JSON reply's validity with them. Needs
    transformers and tiktoken (the vLLM venv has both).
    """
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from tp_llama.tokenizer import LLAMA3_SPECIAL_TOKENS, LLAMA3_SPLIT_PATTERN, load_tokenizer

    ours = load_tokenizer(tokenizer_model)
    converted = TikTokenConverter(str(tokenizer_model), pattern=LLAMA3_SPLIT_PATTERN,
                                  extra_special_tokens=LLAMA3_SPECIAL_TOKENS).converted()
    bos = "<|begin_of_text|>"
    converted.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                      special_tokens=[(bos, ours.bos_id)]),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token=bos, eos_token="<|end_of_text|>",
                                   clean_up_tokenization_spaces=False, model_max_length=131072)
    if fast.convert_tokens_to_ids(bos) != ours.bos_id or len(fast) != ours.n_words:
        raise ValueError(f"{tokenizer_model}: the converted tokenizer's ids differ from ours "
                         f"({len(fast)} ids, BOS {fast.convert_tokens_to_ids(bos)})")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out
