"""torchkv: compressed KV caches for Hugging Face causal language models, in PyTorch."""

from torchkv import methods  # noqa: F401  (registers the presets)
from torchkv.fitting import fit, tune
from torchkv.models import compile_decode_step, load_model, new_cache, patch, patched, pipeline_of, unpatch
from torchkv.pipeline import DEFAULT_PRESET, BitsPerValue, KVPipeline, presets
from torchkv.registry import register_preset, register_transform
from torchkv.version import __version__


__all__ = [
    "__version__",
    "DEFAULT_PRESET",
    "BitsPerValue",
    "KVPipeline",
    "compile_decode_step",
    "fit",
    "load_model",
    "new_cache",
    "patch",
    "patched",
    "pipeline_of",
    "presets",
    "register_preset",
    "register_transform",
    "tune",
    "unpatch",
]
