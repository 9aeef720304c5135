"""Meta's own model code on one of Meta's int4 checkpoints: llama-models 0.3.0's Llama 3 Transformer (on
fairscale's model-parallel layers) with its int4 loader's modules swapped in (llama3/quantization/loader.py:
torchao's Int8DynActInt4WeightLinear plus the QLoRA adaptor, the int8 embedding and output layer), in
float32 on the CPU, as an oracle for tests/test_meta_quantized.py.

    python -m tests.support.meta_int4_model CKPT_DIR TOKENS_JSON OUT_PT

Writes the logits [len(tokens), vocab] of one sequence from position 0. Its own process, because it
starts fairscale's model-parallel group (gloo, world 1). The loader imports fbgemm's GPU operators at
module load for its fp8 and bf16-int4 paths; the int4 path that torchao's modules run never calls them,
so empty modules stand in for that import; and it imports torchao's 8da4w module from where torchao kept
it before 0.18 (`torchao.quantization.GPTQ`), which is pointed at its new home. Its type hints name the
vision model, whose module needs torchvision (PyPI's builds want CUDA's torch): a bare class stands in. llama-models' list of the int4 downloads gives no
quantization scheme, which its loader requires: the one it supports is filled in where absent.
"""

from __future__ import annotations

import json
import socket
import sys
import types
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

SCHEME = "int4_weight_int8_dynamic_activation"


def meta_logits(ckpt: Path, tokens: list[int]) -> torch.Tensor:
    for name in ("fbgemm_gpu", "fbgemm_gpu.experimental", "fbgemm_gpu.experimental.gen_ai"):
        sys.modules.setdefault(name, types.ModuleType(name))
    from torchao.quantization import linear_quant_modules

    gptq = types.ModuleType("torchao.quantization.GPTQ")  # where the loader looks; torchao 0.18 moved the module
    gptq.Int8DynActInt4WeightLinear = linear_quant_modules.Int8DynActInt4WeightLinear
    sys.modules.setdefault(gptq.__name__, gptq)
    vision = types.ModuleType("llama_models.llama3.multimodal.model")  # named in the loader's type hints only
    vision.CrossAttentionTransformer = type("CrossAttentionTransformer", (torch.nn.Module,), {})
    sys.modules.setdefault(vision.__name__, vision)
    from fairscale.nn.model_parallel.initialize import initialize_model_parallel
    from llama_models.llama3.args import ModelArgs
    from llama_models.llama3.model import Transformer
    from llama_models.llama3.quantization.loader import convert_to_int4_quantized_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    initialize_model_parallel(1)
    params = json.loads((ckpt / "params.json").read_text())
    params["quantization_args"].setdefault("scheme", SCHEME)
    model = Transformer(ModelArgs(max_seq_len=len(tokens), max_batch_size=1, **params))
    model = convert_to_int4_quantized_model(model, str(ckpt))
    model.load_state_dict(torch.load(ckpt / "consolidated.00.pth", weights_only=True), strict=True)
    with torch.inference_mode():
        return model(torch.tensor([tokens]), 0)[0].float()


def main(argv: list[str]) -> None:
    ckpt, tokens, out = Path(argv[0]), json.loads(argv[1]), Path(argv[2])
    torch.save(meta_logits(ckpt, tokens), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
