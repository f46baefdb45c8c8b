"""Shared test helpers: error metrics, tiny random models of each supported architecture, K/V capture, and the
loading of scripts that are files, not modules of a package (benchmarks, workers)."""

import importlib.util
import types
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

from torchkv.models import cache_argument

#: config class, and the options making a tiny model of each architecture in the test matrix.
TINY_ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 48}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "gemma2": (
        "Gemma2Config",
        {"head_dim": 32, "sliding_window": 48, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 32},
    ),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 32, "sliding_window": 48, "query_pre_attn_scalar": 32}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", {"pad_token_id": 0}),
}


def load_script(path: str | Path) -> types.ModuleType:
    """The Python file at `path` run as a module named after its stem (a benchmark script, which sits in no
    package: tests and other scripts call its functions)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: `10·log10(‖x‖² / ‖x - x̂‖²)`."""
    reference, approx = reference.double(), approx.double()
    noise = (reference - approx).pow(2).sum().clamp_min(1e-300)
    return float(10 * torch.log10(reference.pow(2).sum() / noise))


def tiny_model(
    model_type: str = "llama",
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides,
):
    """A randomly initialised decoder-only LM (hidden 128, head_dim 32 with 4 heads, vocab 128) of an architecture in `TINY_ARCHITECTURES`."""
    config_name, options = TINY_ARCHITECTURES[model_type]
    options = {
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": 128,
        "max_position_embeddings": 1024,
        **options,
        **overrides,
    }
    config = getattr(transformers, config_name)(**options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def capture_kv(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE keys and values `[B, H, T, D]` of every layer for one forward pass (unpatched model)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, **cache_argument(model, cache), use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def rope_tables(batch: int, tokens: int, dim: int) -> dict[str, torch.Tensor]:
    """Llama-style rotary tables for positions 0..tokens-1: {"cos", "sin"} each `[batch, tokens, dim]`."""
    cos, sin = llama_rope(torch.arange(tokens)[None], dim)
    return {"cos": cos.expand(batch, tokens, dim), "sin": sin.expand(batch, tokens, dim)}


def llama_rope(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-style rotary tables (cos, sin) `[B, T, dim]` of `positions: [B, T]` (a `positions.RopeFn`)."""
    angle = positions[..., None] * 10000 ** (-torch.arange(0, dim, 2, device=positions.device) / dim)
    return angle.cos().repeat(1, 1, 2), angle.sin().repeat(1, 1, 2)
