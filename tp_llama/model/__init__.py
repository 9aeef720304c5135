"""The Llama model: its arguments, its math, the KV cache and the layout of one forward."""

from tp_llama.model.args import ModelArgs
from tp_llama.model.batch import Batch
from tp_llama.model.kv_cache import KVCache
from tp_llama.model.llama import Transformer, TransformerBlock
from tp_llama.model.llama4 import Llama4Block


def build(args: ModelArgs) -> Transformer:
    """The transformer of the family params.json names: Llama 4's blocks (model/llama4.py) or Llama 2/3's."""
    return Transformer(args, Llama4Block if args.family == "llama4" else None)


__all__ = ["Batch", "KVCache", "ModelArgs", "Transformer", "TransformerBlock", "build"]
