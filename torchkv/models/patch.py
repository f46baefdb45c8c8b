"""patch / unpatch: the only entry points that touch a model.

`patch` selects the 'torchkv' attention implementation and adds one forward pre-hook on the model
that hands it a `TorchKVCache` whenever it would otherwise build a fresh `DynamicCache`
(`forward(use_cache=True)` and `generate`), and one on each attention module that stages its input X
for the cache (XQuant caches a function of it); `generate`'s compiled decode steps get the whole-step
Inductor options (`with_whole_step_options`); with `batch_invariant=True` the model's linear layers compute in
fixed blocks of rows. `unpatch` removes them.
"""

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Cache

from torchkv._compat import config_head_dim, own_cache
from torchkv.models import arch
from torchkv.models.attention import ATTENTION_NAME, register
from torchkv.models.batch_invariant import make_linears_batch_invariant, restore_linears
from torchkv.ops.attention import PREFILL_KERNELS
from torchkv.models.cache import TorchKVCache
from torchkv.models.parallel import check_tensor_parallel
from torchkv.models.step import eager_while_preparing, with_whole_step_options
from torchkv.pipeline import CONFIG_FILE, DEFAULT_PRESET, KVPipeline


@dataclass
class _Patch:
    pipeline: KVPipeline
    previous_attention: str
    hooks: list[RemovableHandle]
    prefill_kernel: str
    blocked_linears: list[nn.Linear]
    own_forward: Callable | None  # function of the forward `patch` set (unbound: the registry must not hold the model)


_PATCHES: "weakref.WeakKeyDictionary[nn.Module, _Patch]" = weakref.WeakKeyDictionary()


def resolve_pipeline(pipeline: "KVPipeline | str | Path | None") -> KVPipeline:
    """A pipeline from a `KVPipeline`, a preset name, a `save_pretrained` folder, or None (the default preset)."""
    if pipeline is None:
        return KVPipeline.from_preset(DEFAULT_PRESET)
    if isinstance(pipeline, KVPipeline):
        return pipeline
    if isinstance(pipeline, (str, Path)):
        if (Path(pipeline) / CONFIG_FILE).is_file():
            return KVPipeline.from_pretrained(pipeline)
        return KVPipeline.from_preset(str(pipeline))
    raise TypeError(
        f"expected a KVPipeline, a preset name or a saved pipeline folder, got {type(pipeline).__name__}"
    )


def _check_compatible(model: nn.Module, pipeline: KVPipeline) -> None:
    config = model.config.get_text_config(decoder=True)
    head_dim = config_head_dim(config)
    try:  # a dry run on one chunk surfaces shape errors now rather than mid-generation
        pipeline.bits_per_value(config.num_key_value_heads, head_dim, layers=config.num_hidden_layers)
    except ValueError as err:
        options = f"; its options: {pipeline.options}" if pipeline.options else ""
        raise ValueError(f"pipeline '{pipeline.name}' cannot encode this model's keys and values (head_dim {head_dim}, "
                         f"hidden {config.hidden_size}): {err}{options}") from err
    pipeline.check_fitted(config.num_hidden_layers, arch.fingerprint(model))
    window = getattr(config, "sliding_window", None)
    if any(arch.sliding_windows(model)) and window is not None and window <= pipeline.residual + pipeline.chunk:
        fix = (
            f"use residual <= {window - pipeline.chunk - 1}"
            if window > pipeline.chunk + 1
            else f"use a chunk (token group) below {window - 1}"
        )
        raise ValueError(
            f"the model's sliding window ({window} tokens) is not longer than the pipeline's full-precision "
            f"window (residual {pipeline.residual} + chunk {pipeline.chunk}): its sliding layers would never read "
            f"a compressed token; {fix}, e.g. KVPipeline.from_preset(name, residual=...)"
        )


def new_cache(
    model: nn.Module, pipeline: "KVPipeline | str | Path | None" = None, simulated: bool = False,
    max_cache_len: int | None = None,
) -> TorchKVCache:
    """An empty compressed cache for `model` (the patched pipeline by default), to pass as the cache
    (`**cache_argument(model, cache)`: `cache=` on transformers >= 5.24, `past_key_values=` before).

    `simulated` stores new tokens before attending to them; `max_cache_len` makes the cache compileable, with
    fixed-capacity buffers for that many tokens (see `TorchKVCache`)."""
    state = _PATCHES.get(model)
    if pipeline is None and state is not None:
        pipe = state.pipeline
    else:
        pipe = resolve_pipeline(pipeline)
        check_tensor_parallel(model, pipe)  # before for_model, which would fit XQuant's bases from sharded weights
        pipe = pipe.for_model(model)
    config = model.config.get_text_config(decoder=True)
    if state is None or pipe is not state.pipeline:
        pipe.check_fitted(config.num_hidden_layers, arch.fingerprint(model))
    rope = arch.rope_fns(model) if {"cos", "sin"} & pipe.layers_require else None

    kernel = "auto" if state is None else state.prefill_kernel
    devices = [getattr(next(m.parameters(), None), "device", None) for m in arch.attention_modules(model)]
    cache = TorchKVCache(pipe, config.num_hidden_layers, rope, arch.sliding_windows(model), simulated, kernel,
                         max_cache_len, devices)
    cache.model = weakref.ref(model)
    return cache


#: the keywords a cache travels under: `cache` since transformers 5.24, `past_key_values` before (and its
#: deprecated alias since); both are read, and a cache is put under the name the model's forward declares
CACHE_KWARGS = ("cache", "past_key_values")


def _passed_cache(kwargs: dict) -> tuple[str | None, object]:
    """(keyword, cache) of the cache a forward call received, or (None, None)."""
    for key in CACHE_KWARGS:
        if kwargs.get(key) is not None:
            return key, kwargs[key]
    return None, None


def _stage_layer_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Attention pre-hook: give the layer's torchkv cache the attention block's input X (after its norm)."""
    cache = _passed_cache(kwargs)[1]
    if isinstance(cache, TorchKVCache) and cache.layers[module.layer_idx].store.tracks_input:
        cache.layers[module.layer_idx].layer_input = arch.attention_input(args, kwargs)


def _cache_keyword(model: nn.Module) -> str:
    """The keyword `model.forward` takes its cache under (see `CACHE_KWARGS`)."""
    parameters = inspect.signature(model.forward).parameters
    return next((key for key in CACHE_KWARGS if key in parameters), "past_key_values")


def cache_argument(model: nn.Module, cache) -> dict:
    """`{keyword: cache}` for `model(...)`: `cache` where the forward takes it (transformers ≥ 5.24), else
    `past_key_values` (which 5.24 still reads, with a FutureWarning)."""
    return {_cache_keyword(model): cache}


def _static_length(cache: StaticCache) -> int:
    """The generation length an empty `StaticCache` was made for (what its full-attention layers hold)."""
    full = [layer.max_cache_len for layer in cache.layers if not getattr(layer, "is_sliding", False)]
    if not full:
        raise ValueError(
            "every layer of this model attends through a sliding window, so transformers' StaticCache does not "
            "record the generation length, which bounds the token indices of torchkv's fixed-capacity buffers: pass "
            "torchkv.new_cache(model, max_cache_len=N) as the cache instead of cache_implementation='static'"
        )
    return max(full)


def _use_torchkv_cache(model: nn.Module, keyword: str, args: tuple, kwargs: dict):
    """Forward pre-hook: put a torchkv cache where the model would create a DynamicCache."""
    key, cache = _passed_cache(kwargs)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = model.config.get_text_config(decoder=True).use_cache
    if isinstance(cache, TorchKVCache):
        cache.check_model(model)
        return None
    if cache is None and not use_cache:
        return None
    if cache is None or (type(cache) is DynamicCache and cache.get_seq_length() == 0):
        kwargs[key or keyword] = new_cache(model)
        return args, kwargs
    if type(cache) is StaticCache and not cache.is_initialized:  # generate(cache_implementation="static")
        kwargs[key or keyword] = new_cache(model, max_cache_len=_static_length(cache))
        return args, kwargs
    if isinstance(cache, Cache):
        raise ValueError(
            f"a model patched by torchkv got a {type(cache).__name__} holding {cache.get_seq_length()} tokens; "
            f"pass {key}=torchkv.new_cache(model) (or nothing), or torchkv.unpatch(model) first"
        )
    return None


def patch(
    model: nn.Module, pipeline: "KVPipeline | str | Path | None" = None, prefill_kernel: str = "auto",
    batch_invariant: bool = False,
) -> nn.Module:
    """Make `model` use a compressed KV cache in `forward(use_cache=True)` and `generate`.

    Args:
        model: a Hugging Face decoder-only causal LM (see `torchkv.models.arch.ARCHITECTURES`).
        pipeline: a `KVPipeline`, a preset name, a folder written by `save_pretrained`, or None for
            the default preset. Patching an already patched model replaces its pipeline.
        prefill_kernel: "flex", "sdpa" or "auto" (see `torchkv.ops.attention.PREFILL_KERNELS`).
        batch_invariant: compute the model's linear layers in fixed blocks of rows
            (`torchkv.models.batch_invariant`), so that a request's logits do not depend on the batch it runs in,
            bit for bit (on 2 CPU cores: prompts about 2.5x slower, decode at batch 1 about 1.8x).

    Returns:
        the same model object.
    """
    attention = arch.attention_modules(model)  # raises a clear error for unsupported models
    if prefill_kernel not in PREFILL_KERNELS:
        raise ValueError(f"prefill_kernel={prefill_kernel!r}; allowed: {PREFILL_KERNELS}")
    pipe = resolve_pipeline(pipeline)
    check_tensor_parallel(model, pipe)  # before for_model, which would fit XQuant's bases from sharded weights
    pipe = pipe.for_model(model)
    _check_compatible(model, pipe)
    if model in _PATCHES:
        unpatch(model)
    blocked = make_linears_batch_invariant(model) if batch_invariant else []  # (refuses before anything changes)
    register()
    previous, keyword = model.config._attn_implementation, _cache_keyword(model)
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        restore_linears(blocked)
        raise NotImplementedError(
            f"{type(model).__name__} does not let its attention implementation be set; torchkv cannot patch it"
        )
    hooks = [model.register_forward_pre_hook(
        lambda module, args, kwargs: _use_torchkv_cache(model, keyword, args, kwargs), with_kwargs=True
    )] + [m.register_forward_pre_hook(_stage_layer_input, with_kwargs=True) for m in attention]
    compiled_call = type(model).get_compiled_call
    model.get_compiled_call = lambda config: eager_while_preparing(model, compiled_call(
        model, with_whole_step_options(config or model._default_compile_config())))
    # `generate`'s compiled step enters dynamo at the forward: one code object for every model of a class would
    # count each patch's graphs against the others' recompile limit (a hard error under fullgraph=True, eager code
    # otherwise). A forward already set on the instance (accelerate's hooks) is left as it is.
    own_forward = None
    if "forward" not in vars(model):
        model.forward = own_cache(model.forward)
        own_forward = model.forward.__func__
    _PATCHES[model] = _Patch(pipe, previous, hooks, prefill_kernel, blocked, own_forward)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo `patch`: the original attention implementation and no hook."""
    if model not in _PATCHES:
        raise ValueError(f"{type(model).__name__} is not patched by torchkv")
    state = _PATCHES.pop(model)
    for hook in state.hooks:
        hook.remove()
    restore_linears(state.blocked_linears)
    del model.get_compiled_call
    if state.own_forward is not None and getattr(vars(model).get("forward"), "__func__", None) is state.own_forward:
        del model.forward  # (one that wraps it, set after `patch`, stays)
    model.set_attn_implementation(state.previous_attention)
    return model


def pipeline_of(model: nn.Module) -> KVPipeline | None:
    """The pipeline a model is patched with, or None."""
    state = _PATCHES.get(model)
    return None if state is None else state.pipeline


@contextlib.contextmanager
def patched(
    model: nn.Module, pipeline: "KVPipeline | str | Path | None" = None, prefill_kernel: str = "auto",
    batch_invariant: bool = False,
) -> Iterator[nn.Module]:
    """`with torchkv.patched(model, "kivi-2bit"): model.generate(...)` — unpatched on exit."""
    patch(model, pipeline, prefill_kernel, batch_invariant)
    try:
        yield model
    finally:
        unpatch(model)
