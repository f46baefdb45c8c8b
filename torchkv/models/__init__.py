"""The Hugging Face side: patch/unpatch, the compressed Cache, the attention function, architectures."""

from torchkv.models.cache import TorchKVCache, TorchKVLayer
from torchkv.models.loader import load_model
from torchkv.models.patch import cache_argument, new_cache, patch, patched, pipeline_of, unpatch
from torchkv.models.step import compile_decode_step
from torchkv.models.weights import specialize  # noqa: F401  (serves KVPipeline.for_model)

__all__ = [
    "TorchKVCache", "TorchKVLayer", "cache_argument", "compile_decode_step", "load_model", "new_cache", "patch", "patched", "pipeline_of",
    "unpatch",
]
