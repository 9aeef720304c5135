"""Small checkpoints in the formats Meta quantizes its own downloads in, written the way its files hold
them (tp_llama.checkpoint.formats describes them), from a random-weight checkpoint (testing.synthetic).

- int4 (Llama 3.2 QLoRA / SpinQuant): every linear of the layers quantized by torchao's own quantizer
  (`Int8DynActInt4WeightQuantizer`, int8 values -8..7 with float32 group scales and zero points), QLoRA's
  adaptor as two small bfloat16 matrices, the embedding and output layer int8 with a float32 scale a row;
  SpinQuant's w2 stored as w2 H (H the normalized Hadamard matrix), so that w2 H (H x) is the unrotated
  model's w2 x. params.json gains quantization_args (and lora_args).
- fp8 (Llama 3.1 405B): the feed-forward weights of every layer but the first and last cast to float8
  e4m3 with one float32 scale per row of each MP shard, in fp8_scales_N.pt.

Usage: python -m tp_llama.testing.meta_quant OUT int4|fp8 [--group 32] [--lora-rank 0] [--spinquant] [--mp 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tp_llama.kernels.meta_int4 import walsh_hadamard
from tp_llama.testing.synthetic import write_checkpoint

LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
FP8_MAX = 448.0


def torchao_int4(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """{"weight", "scales", "zeros"} of one weight [out, k], from torchao's 8da4w quantizer."""
    from torchao.quantization.linear_quant_modules import Int8DynActInt4WeightQuantizer

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.float()
    state = Int8DynActInt4WeightQuantizer(groupsize=group, precision=torch.float32)._create_quantized_state_dict(
        torch.nn.Sequential(linear))
    return {"weight": state["0.weight"], "scales": state["0.scales"], "zeros": state["0.zeros"]}


def int8_rows(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A table [rows, cols] as int8 with a float32 scale a row ([rows, 1]), symmetric."""
    w = weight.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return {"weight": (w / scales).round().clamp(-127, 127).to(torch.int8), "scales": scales}


def _params(out: Path, update: dict) -> None:
    path = out / "params.json"
    params = json.loads(path.read_text())
    params.update(update)
    path.write_text(json.dumps(params, indent=2) + "\n")


def write_int4_checkpoint(out: str | Path, group: int = 32, lora_rank: int = 0, lora_scale: float = 2.0,
                          spinquant: bool | None = None, zeros: bool = True, scheme: bool = False, seed: int = 0,
                          **sizes) -> Path:
    """A Llama 3 layout (MP 1) in Meta's int4 format. spinquant: w2 stored rotated; params.json says
    so where True (None: rotated, with no key, as llama-models lists SpinQuant). zeros: keep the zero
    points torchao writes (Meta's loader takes them as zero when absent)."""
    out = write_checkpoint(out, family="llama3", mp=1, dtype=torch.float32, seed=seed, **sizes)
    path = out / "consolidated.00.pth"
    state = torch.load(path, weights_only=True)
    gen = torch.Generator().manual_seed(seed + 1)
    rotate = spinquant is None and not lora_rank or bool(spinquant)
    quantized: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        base = key.removesuffix(".weight")
        module = ".".join(base.split(".")[2:])
        if module in LINEARS:
            weight = walsh_hadamard(tensor.double()).float() if rotate and module == "feed_forward.w2" else tensor
            parts = torchao_int4(weight, group)
            if not zeros:
                del parts["zeros"]
            quantized.update({f"{base}.{name}": value for name, value in parts.items()})
            if lora_rank:
                out_features, k = tensor.shape
                a = torch.randn(lora_rank, k, generator=gen) / k**0.5
                b = torch.randn(out_features, lora_rank, generator=gen) * 0.5 / lora_rank**0.5
                quantized[f"{base}.adaptor.A.weight"] = a.bfloat16()
                quantized[f"{base}.adaptor.B.weight"] = b.bfloat16()
        elif base in ("tok_embeddings", "output"):
            quantized.update({f"{base}.{name}": value for name, value in int8_rows(tensor).items()})
        else:
            quantized[key] = tensor.bfloat16()
    torch.save(quantized, path)
    args: dict = {"group_size": group}
    if scheme:
        args["scheme"] = "int4_weight_int8_dynamic_activation"
    if spinquant is not None:
        args["spinquant"] = spinquant
    _params(out, {"quantization_args": args, **({"lora_args": {"rank": lora_rank, "scale": lora_scale}}
                                                if lora_rank else {})})
    return out


def write_fp8_checkpoint(out: str | Path, mp: int = 1, seed: int = 0, **sizes) -> Path:
    """A Llama 3 layout over `mp` files with the feed-forward weights of layers 1..n-2 in float8 and
    their row scales in fp8_scales_N.pt, as Meta's 405B FP8 download holds them."""
    out = write_checkpoint(out, family="llama3", mp=mp, dtype=torch.bfloat16, seed=seed, **sizes)
    n_layers = json.loads((out / "params.json").read_text())["n_layers"]
    for m in range(mp):
        path = out / f"consolidated.{m:02d}.pth"
        state = torch.load(path, weights_only=True)
        scales = {}
        for layer in range(1, n_layers - 1):
            for w in ("w1", "w2", "w3"):
                key = f"layers.{layer}.feed_forward.{w}.weight"
                weight = state[key].float()
                scale = (weight.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
                state[key] = (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                scales[f"{layer}_feed_forward.{w}_{m}"] = scale
        torch.save(state, path)
        torch.save(scales, out / f"fp8_scales_{m}.pt")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("format", choices=("int4", "fp8"))
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--spinquant", action="store_true")
    parser.add_argument("--mp", type=int, default=1)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=3)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--n-kv-heads", type=int, default=4)
    parser.add_argument("--multiple-of", type=int, default=32)
    parser.add_argument("--ffn-dim-multiplier", type=float, default=None)
    parser.add_argument("--vocab-size", type=int, default=512)
    a = parser.parse_args(argv)
    sizes = dict(dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                 multiple_of=a.multiple_of, ffn_dim_multiplier=a.ffn_dim_multiplier, vocab_size=a.vocab_size)
    if a.format == "int4":
        out = write_int4_checkpoint(a.out, a.group, a.lora_rank, spinquant=a.spinquant, **sizes)
    else:
        out = write_fp8_checkpoint(a.out, a.mp, **sizes)
    print(f"wrote a Meta {a.format} checkpoint to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
