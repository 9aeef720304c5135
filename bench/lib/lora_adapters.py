"""Random LoRA adapters in PEFT's files, for the serving benchmarks: ours and vLLM read the same folders.

    python -m bench.lib.lora_adapters --preset llama3.2-1b [--count 8] [--rank 16]

Each adapter is a folder as PEFT's save_pretrained writes one: adapter_config.json (r, lora_alpha, all seven
projections of a Llama layer as target_modules) and adapter_model.safetensors under PEFT's names
(base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight, ...), A [r, in] and B [out, r] float32 in
Hugging Face's layout. Both factors are random: a fresh PEFT adapter has B = 0 and would leave every reply the
base's, so neither server's adapter path would show in its replies. Written once per checkpoint, rank and
count under bench/out/lora/, and read back by the server's own reader (tp_llama.lora.adapters) before use.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import OUT
from tp_llama.checkpoint.params import read_params
from tp_llama.lora.adapters import read_adapter
from tp_llama.model import ModelArgs
from tp_llama.tokenizer import load_tokenizer

# Hugging Face's projections of a Llama layer, as PEFT names its target modules.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The synthetic base's weights have a spread of 2 / sqrt(in) (tp_llama/testing/synthetic.py); each adapter's
# scaled B @ A gets this share of it: enough to change greedy replies, not enough to swamp the base.
SHARE = 0.25


def projection_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(out, in) of each target module, under its parent's name as PEFT's keys spell it."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {"self_attn.q_proj": (q, args.dim), "self_attn.k_proj": (kv, args.dim), "self_attn.v_proj": (kv, args.dim),
            "self_attn.o_proj": (args.dim, q), "mlp.gate_proj": (args.ffn_dim, args.dim),
            "mlp.up_proj": (args.ffn_dim, args.dim), "mlp.down_proj": (args.dim, args.ffn_dim)}


def write_adapter(folder: Path, args: ModelArgs, rank: int, seed: int) -> Path:
    """One random rank-`rank` adapter on every projection of every layer, in PEFT's files; lora_alpha is
    2 * rank (a common choice), and B's spread is set so the scaled product has SHARE of the base's."""
    from safetensors.torch import save_file

    alpha = 2 * rank
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(args.n_layers):
        for module, (out_features, in_features) in projection_shapes(args).items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            # (alpha / r) * sum_r B A has spread (alpha / r) * b_std * sqrt(r) / sqrt(in) with A's spread 1 / sqrt(in).
            b_std = SHARE * 2 * math.sqrt(rank) / alpha
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / math.sqrt(in_features)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * b_std
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
              "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": False, "inference_mode": True,
              "base_model_name_or_path": None}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def ensure_adapters(ckpt: Path, count: int, rank: int, seed: int = 0, root: Path = OUT / "lora") -> list[Path]:
    """`count` adapters for the checkpoint in `ckpt` (adapter i seeded seed + i), written once; each read back
    by the server's reader, which must find all seven projections of every layer at this rank."""
    args = read_params(ckpt, load_tokenizer(ckpt / "tokenizer.model").n_words)
    base = root / f"{ckpt.name}-r{rank}-s{seed}"
    folders = [base / f"adapter{i}" for i in range(count)]
    stamp = json.dumps({"ckpt": str(ckpt.resolve()), "rank": rank, "seed": seed, "share": SHARE})
    for i, folder in enumerate(folders):
        if (folder / "bench-source.json").is_file() and (folder / "bench-source.json").read_text() == stamp:
            continue
        print(f"writing LoRA adapter {i} (rank {rank}) for {ckpt.name} to {folder}", flush=True)
        write_adapter(folder, args, rank, seed + i)
        adapter = read_adapter(folder.name, str(folder), args, rank)
        if adapter.rank != rank or len(adapter.weights) != len(TARGETS) * args.n_layers:
            raise ValueError(f"{folder}: the server's reader found {len(adapter.weights)} modules of rank "
                             f"{adapter.rank}, not {len(TARGETS) * args.n_layers} of rank {rank}")
        (folder / "bench-source.json").write_text(stamp)
    return folders


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    for folder in ensure_adapters(ensure_checkpoint(PRESETS[a.preset], mp=1), a.count, a.rank, a.seed):
        print(folder)


if __name__ == "__main__":
    main()
