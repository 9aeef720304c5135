"""The Llama model: its arguments, its math, the KV cache and the layout of one forward."""

from tp_llama.model.args import ModelArgs
from tp_llama.model.batch import Batch
from tp_llama.model.kv_cache import KVCache
from tp_llama.model.llama import Transformer, TransformerBlock

__all__ = ["Batch", "KVCache", "ModelArgs", "Transformer", "TransformerBlock"]
