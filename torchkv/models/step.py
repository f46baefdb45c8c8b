"""A decode step compiled whole over a fixed-capacity torchkv cache, with window flushes called from the host."""

import copy
from collections.abc import Callable

import torch
from torch._inductor import list_mode_options
from transformers import CompileConfig

from torchkv._compat import own_cache
from torchkv.models.cache import TorchKVCache

#: Inductor options of whole-step graphs: quantization rounds through the stored dtypes exactly as eager does
WHOLE_STEP_OPTIONS = {"emulate_precision_casts": True}


def compile_decode_step(model, cuda_graphs: bool | None = None) -> Callable:
    """`model.forward` compiled as one graph (fullgraph, static shapes) for decode steps, under CUDA graphs on GPUs.

    The returned callable takes the forward's arguments. When its cache is a fixed-capacity `TorchKVCache`
    (`torchkv.new_cache(model, max_cache_len=N)`), the step graph only writes the new token and attends: after
    each step the host counts the token and, on the steps that fill the window (one in `chunk`), encodes the
    window's oldest chunk outside the graph. A step compiled without this callable encodes a chunk inside every
    step on CUDA (kept only when the window is full), which CUDA graphs need to capture the step whole. A padded
    batch's 2-D `attention_mask`, one column longer at every step, is padded with zeros to the cache's capacity
    (as transformers pads it for a fixed-capacity cache), so that every step has the shapes of the first.

    Dynamo checks a graph's guards on the host before every call. Those on the model's modules (their attributes,
    hooks and parameters) are left out: the 1B shape's 16-layer step (`compiled:kivi-2bit`) checked its guards in
    1.84 ms per step with them and 0.79 ms without (this project's 2-core Xeon), host time of every step at batch 1
    on a GPU. Guards on the cache (its stores, row groups, pipeline settings) and on every tensor's shape, dtype and
    device stay, so a cache that differs compiles a graph of its own (tested for another batch size). Build a new
    callable after patching the model again or changing its modules.

    Args:
        model: a model patched by torchkv (or any model, for transformers' own `StaticCache`).
        cuda_graphs: replay the step as a CUDA graph; None: on CUDA models.
    """
    if cuda_graphs is None:
        cuda_graphs = model.device.type == "cuda"
    # torch 2.11 refuses mode="reduce-overhead" together with options: CUDA graphs are asked for as an option
    options = {**WHOLE_STEP_OPTIONS, "triton.cudagraphs": cuda_graphs,
               "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    compiled = eager_while_preparing(
        model, torch.compile(own_cache(model.forward), fullgraph=True, dynamic=False, options=options))

    def step(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        tokens = next((x.shape[1] for x in (kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if x is not None), 0)
        frozen = []
        if isinstance(cache, TorchKVCache) and tokens == 1:
            frozen = [store for layer in cache.layers for store in layer.frozen_stores() or []]
        if frozen and kwargs.get("attention_mask") is not None:
            kwargs["attention_mask"] = _to_capacity(kwargs["attention_mask"], cache.layers[0].get_mask_sizes(1)[0])
        for store in frozen:  # only while this callable steps: another caller's steps flush inside the graph
            store.host_flush = True
        try:
            out = compiled(*args, **kwargs)
        finally:
            for store in frozen:
                store.host_flush = False
        for store in frozen:
            store.flush_if_full()
        return out

    return step


def eager_while_preparing(model, compiled: Callable) -> Callable:
    """`compiled` (a compiled forward of `model`), but the eager forward while the step's torchkv cache awaits the
    tokens its pipeline prepares from (`TorchKVCache.awaits_prepare`: a prompt shorter than a chunk), whose stores
    are not frozen into the fixed-capacity buffers yet."""

    def forward(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, TorchKVCache) and cache.awaits_prepare:
            return model.forward(*args, **kwargs)
        return compiled(*args, **kwargs)

    return forward


def _to_capacity(mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """A 2-D padding mask `[B, T]` padded with zeros to `[B, capacity]`, as transformers pads it for a fixed-capacity
    cache: the same shape at every step. Other masks are returned as they are."""
    if mask.dim() != 2 or mask.shape[1] >= capacity:
        return mask
    return torch.nn.functional.pad(mask, (0, capacity - mask.shape[1]))


def with_whole_step_options(config: CompileConfig) -> CompileConfig:
    """`generate`'s compile config with `WHOLE_STEP_OPTIONS` added where Inductor compiles (what a patched model's
    `get_compiled_call` compiles with). Without them Inductor may keep a scale in float32 where eager code rounds it
    to its stored dtype. A `mode` becomes its options, since torch takes one or the other."""
    options = config.options or {}
    if config.backend != "inductor" or all(options.get(k) == v for k, v in WHOLE_STEP_OPTIONS.items()):
        return config
    config = copy.copy(config)
    config.options = {**({} if config.mode is None else list_mode_options(config.mode)), **options,
                      **WHOLE_STEP_OPTIONS}
    config.mode = None
    return config
