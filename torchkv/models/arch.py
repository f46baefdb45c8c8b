"""Per-architecture facts, keyed by `config.model_type`: where the attention modules and the rotary
embedding live. Method code never branches on the model family; it asks here."""

import contextlib
import hashlib
import inspect
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from torchkv._compat import config_head_dim
from torchkv.ops.attention import attend_dense
from torchkv.store import RopeFn


@dataclass(frozen=True)
class Arch:
    """Where a decoder-only model keeps its parts (dotted attribute paths from the CausalLM)."""

    layers: str = "model.layers"
    attention: str = "self_attn"
    rotary: str = "model.rotary_emb"


#: model types whose attention follows the v5 contract (`past_key_values.update` then
#: `AttentionInterface`) and whose RoPE uses the rotate-half convention.
ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch(),
    "mistral": Arch(),
    "qwen2": Arch(),
    "qwen3": Arch(),
    "gemma2": Arch(),
    "gemma3_text": Arch(),
    "phi3": Arch(),
    "olmo2": Arch(),
}


def _get(obj: object, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def arch_of(model: nn.Module) -> Arch:
    """The architecture entry of `model`, or a clear error naming what is supported."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        raise TypeError(
            f"torchkv.patch needs a Hugging Face causal LM (a PreTrainedModel with generate()), "
            f"got {type(model).__name__}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"{type(model).__name__} is an encoder-decoder model; torchkv supports decoder-only LMs")
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise NotImplementedError(
            f"model type '{model_type}' ({type(model).__name__}) is not supported by torchkv; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}. A new decoder-only family whose attention "
            "calls past_key_values.update and AttentionInterface needs one entry in torchkv/models/arch.py"
        )
    return ARCHITECTURES[model_type]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    arch = arch_of(model)
    try:
        layers = _get(model, arch.layers)
        modules = [_get(layer, arch.attention) for layer in layers]
    except AttributeError as err:
        raise NotImplementedError(
            f"{type(model).__name__} has no '{arch.layers}[i].{arch.attention}'; it cannot be hooked by torchkv"
        ) from err
    if not modules or any(not hasattr(m, "layer_idx") for m in modules):
        raise NotImplementedError(f"{type(model).__name__}: attention modules without layer_idx have no KV cache path")
    return modules


def attention_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states an attention module's forward receives (its input X, after the layer's norm), from
    a forward pre-hook's arguments."""
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def rope_fn(model: nn.Module, layer_idx: int) -> RopeFn:
    """positions [B, T] -> (cos, sin) [B, T, R] with the model's own rotary embedding for that layer."""
    return _rope_of_type(model, _rope_type(model, layer_idx))


def rope_fns(model: nn.Module) -> list[RopeFn]:
    """`rope_fn` of every layer, one function object for the layers that share a rotary embedding (Gemma 3: one for
    its sliding layers, one for its global ones)."""
    types = [_rope_type(model, i) for i in range(model.config.get_text_config(decoder=True).num_hidden_layers)]
    by_type = {t: _rope_of_type(model, t) for t in set(types)}
    return [by_type[t] for t in types]


def _rope_type(model: nn.Module, layer_idx: int) -> str | None:
    """The layer type the model's rotary embedding takes for that layer, or None where it takes none."""
    rotary = _get(model, arch_of(model).rotary)
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        return None
    return model.config.get_text_config(decoder=True).layer_types[layer_idx]


def _rope_of_type(model: nn.Module, layer_type: str | None) -> RopeFn:
    rotary = _get(model, arch_of(model).rotary)
    per_type = layer_type is not None
    dtype = next(model.parameters()).dtype

    def rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        if per_type:
            return rotary(probe, positions, layer_type)
        return rotary(probe, positions)

    return rope


def sliding_windows(model: nn.Module) -> list[int | None]:
    """The sliding window (tokens) each layer attends through, or None (from `config.layer_types`)."""
    config = model.config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:  # Mistral-style: one window for every layer, or none
        return [window] * config.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


def full_layers(model: nn.Module) -> list[int]:
    """The layers that hold every token, where the model also has sliding-window layers (which hold at most their
    window): the cache's bits per value tend to their mean at contexts past the window. Empty where every layer
    holds the same tokens."""
    windows = sliding_windows(model)
    full = [i for i, window in enumerate(windows) if window is None]
    return full if len(full) < len(windows) else []


@contextlib.contextmanager
def swapped_attention(
    model: nn.Module, name: str, attention: Callable, pre_hooks: Sequence[tuple[nn.Module, Callable]] = (),
) -> Iterator[None]:
    """`model` with its attention computed by `attention` (an `AttentionInterface` function, registered as `name`
    with SDPA's masks) and each `(module, hook)` forward pre-hook installed (`hook(module, args, kwargs)`); the
    model's own attention comes back and the hooks go on exit."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    handles = [module.register_forward_pre_hook(hook, with_kwargs=True) for module, hook in pre_hooks]
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        for handle in handles:
            handle.remove()


def sdpa_with_softcap(module: nn.Module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (an `AttentionInterface` function, with SDPA's masks), computed densely with the
    model's logit soft-capping `c·tanh(s/c)` where it passes one (Gemma 2), which SDPA has not; `[B, Q, Hq, D]`."""
    softcap = kwargs.get("softcap")
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)[0], None
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:  # SDPA's mask function leaves plain causal masks to is_causal
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)
        attention_mask = attention_mask.tril(kv_len - q_len)[None, None]
    out, _ = attend_dense(query, key, value, attention_mask, kwargs.get("scaling") or module.scaling, softcap)
    return out.transpose(1, 2).contiguous(), None


#: config fields that decide the shapes and the meaning of a model's keys and values
_FINGERPRINT_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "rope_parameters",
    "max_position_embeddings", "tie_word_embeddings",
)


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """What a calibration is valid for: the model type, its KV shapes and a hash of its architecture config."""
    config = model.config.get_text_config(decoder=True)
    fields = {name: getattr(config, name, None) for name in _FINGERPRINT_FIELDS}
    digest = hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config_head_dim(config),
        "config_sha1": digest,
    }
