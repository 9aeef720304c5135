"""PEFT on transformers' LlamaForCausalLM, the reference of the LoRA tests: a small random Meta-layout base, the
same weights as Hugging Face's model, PEFT adapters saved and merged by PEFT itself, and torchtune's layout of
the same adapter (what its Meta-format checkpointer writes)."""

from __future__ import annotations

import re
from pathlib import Path

from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from bench.lib.hf_convert import hf_config, meta_to_hf, to_hf_rotary
from tp_llama.checkpoint.params import read_params
from tp_llama.model import ModelArgs
from tp_llama.testing.synthetic import write_checkpoint
from tp_llama.tokenizer import load_tokenizer

if TYPE_CHECKING:  # imported where used: peft and transformers take seconds, at every xdist worker's collection
    from peft import PeftModel
    from transformers import LlamaForCausalLM

# Small enough to build many models in a test, with GQA and an FFN width unlike dim, so that a factor read
# into the wrong module or rotary order cannot fit by accident.
BASE_SHAPE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}
# Hugging Face's module names -> torchtune's, under a layer.
TUNE_NAMES = {"self_attn.q_proj": "attn.q_proj", "self_attn.k_proj": "attn.k_proj", "self_attn.v_proj": "attn.v_proj",
              "self_attn.o_proj": "attn.output_proj", "mlp.gate_proj": "mlp.w1", "mlp.down_proj": "mlp.w2",
              "mlp.up_proj": "mlp.w3"}
_PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight")


def write_base(folder: Path, seed: int = 0) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """A random float32 Meta checkpoint in folder (the project's synthetic writer), its args and its weights."""
    write_checkpoint(folder, dtype=torch.float32, seed=seed, **BASE_SHAPE)
    args = read_params(folder, load_tokenizer(folder / "tokenizer.model").n_words)
    state = torch.load(folder / "consolidated.00.pth", map_location="cpu", weights_only=True)
    return args, state


def hf_model(state: dict[str, torch.Tensor], args: ModelArgs) -> LlamaForCausalLM:
    """The Meta weights as transformers' model (its names and rotary order)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_config(args, max_len=64))
    model.load_state_dict(meta_to_hf(state, args))
    return model.eval()


def save_peft(state: dict[str, torch.Tensor], args: ModelArgs, folder: Path, seed: int = 0, **lora) -> PeftModel:
    """PEFT's LoRA on the base with LoraConfig(**lora), saved to folder by PEFT. Both factors are random from
    seed (init_lora_weights=False), so that B @ A is far from zero and every module's delta differs."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(state, args), LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(folder)
    return model


def merged(model: PeftModel) -> dict[str, torch.Tensor]:
    """PEFT's own merge of its adapter: the fine-tuned weights in Hugging Face's names and order."""
    return {key: value.detach().clone() for key, value in model.merge_and_unload().state_dict().items()}


def meta_rows(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows in Hugging Face's rotary order put back in Meta's, found by sending row numbers through the
    conversion rather than by inverting its reshape (the reader under test does that)."""
    order = to_hf_rotary(torch.arange(rows.shape[0]).unsqueeze(1), n_heads)[:, 0]
    return rows[torch.argsort(order)]


def write_torchtune(peft_folder: Path, out: Path, args: ModelArgs, name: str = "adapter_model.pt") -> Path:
    """The PEFT adapter saved in peft_folder as torchtune's Meta-format checkpointer writes one: torchtune's
    names, unscaled factors, B's q / k rows in Meta's order; no config (its alpha lives in the recipe)."""
    tune = {}
    for key, tensor in load_file(peft_folder / "adapter_model.safetensors").items():
        layer, module, part = _PEFT_KEY.fullmatch(key).groups()
        if part == "B" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            tensor = meta_rows(tensor, args.n_heads if module == "self_attn.q_proj" else args.n_kv_heads)
        tune[f"layers.{layer}.{TUNE_NAMES[module]}.lora_{part.lower()}.weight"] = tensor.clone()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(tune, out / name)
    return out
