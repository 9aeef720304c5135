"""A random LoRA adapter for a checkpoint, written as torchtune's Meta-format checkpointer writes one (torch
alone, so a served test need not import PEFT): every module of every layer, its B far from zero."""

from __future__ import annotations

from pathlib import Path

import torch

from tp_llama.model import ModelArgs

TUNE_MODULES = {"wq": "attn.q_proj", "wk": "attn.k_proj", "wv": "attn.v_proj", "wo": "attn.output_proj",
                "w1": "mlp.w1", "w2": "mlp.w2", "w3": "mlp.w3"}


def write_random_adapter(folder: Path, args: ModelArgs, rank: int = 8, seed: int = 0) -> Path:
    """adapter_model.pt in folder; its yaml entry needs lora_alpha (torchtune keeps it in the recipe)."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    shapes = {"wq": (args.dim, q), "wk": (args.dim, kv), "wv": (args.dim, kv), "wo": (q, args.dim),
              "w1": (args.dim, args.ffn_dim), "w2": (args.ffn_dim, args.dim), "w3": (args.dim, args.ffn_dim)}
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(args.n_layers):
        for module, (fan_in, fan_out) in shapes.items():
            name = f"layers.{layer}.{TUNE_MODULES[module]}"
            weights[f"{name}.lora_a.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            weights[f"{name}.lora_b.weight"] = torch.randn(fan_out, rank, generator=gen) / rank**0.5
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(weights, folder / "adapter_model.pt")
    return folder
