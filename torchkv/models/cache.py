"""The compressed Cache handed to Hugging Face models: one `TorchKVLayer` (a `CacheLayerMixin`) per layer.

`update` only stages the new keys and values and returns the layer itself as a handle; the attention
function registered by torchkv reads the handle, attends over the compressed history plus the new
tokens, and then commits the new tokens to the layer's `KVStore`.
"""

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from torchkv.models.attention import PREFILL_KERNELS
from torchkv.pipeline import KVPipeline
from torchkv.store import CrossLayer, KVStore, RopeFn


class TorchKVLayer(CacheLayerMixin):
    """One layer's compressed cache, behind transformers' per-layer cache contract."""

    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        pipeline: KVPipeline,
        layer_idx: int,
        rope: RopeFn | None = None,
        is_sliding: bool = False,
        simulated: bool = False,
        prefill_kernel: str = "auto",
        cross_layer: CrossLayer | None = None,
    ):
        super().__init__()
        self.store = KVStore(pipeline, layer_idx, rope, cross_layer)
        self.is_sliding = is_sliding
        self.simulated = simulated
        self.prefill_kernel = prefill_kernel
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        #: [B, T, d] the attention block's input for the staged tokens, when the pipeline reads it
        #: (set by the attention pre-hook `patch` installs)
        self.layer_input: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Stage `[B, H, T, D]` keys and values; return handles for the torchkv attention function."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending is not None:
            raise RuntimeError(
                f"layer {self.store.layer}: update() called twice without attention in between; a patched "
                "model must use the 'torchkv' attention implementation (do not change it after torchkv.patch)"
            )
        self.pending = (key_states, value_states)
        return self, self

    def commit(
        self, valid: torch.Tensor | None, positions: torch.Tensor | None, inputs: dict,
        attention: torch.Tensor | None = None,
    ) -> None:
        """Move the staged tokens into the store (called by the attention function after attending;
        `attention` as `KVStore.append` takes it)."""
        k, v = self.pending
        self.pending = None
        if self.layer_input is not None:
            inputs = {**inputs, "x": self.layer_input}
            self.layer_input = None
        self.store.append(k, v, valid=valid, positions=positions, inputs=inputs, attention=attention)

    def get_seq_length(self) -> int:
        staged = 0 if self.pending is None else self.pending[0].shape[2]
        return self.store.length + staged

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # every token is kept (absolute kv indices), the mask function applies any sliding window
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store.reset()
        self.pending = self.layer_input = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.reorder(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers' negative-count convention)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number, the count of tokens to remove from the end"
            )
        self.store.crop(-tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.store.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.store.reorder(torch.as_tensor(indices))

    def offload(self):
        raise NotImplementedError("torchkv caches are not offloaded; the compressed store stays on the layer's device")

    prefetch = offload


class TorchKVCache(Cache):
    """A `Cache` whose layers store keys and values compressed by a `KVPipeline`.

    Args:
        pipeline: the compression recipe.
        num_layers: decoder layers.
        rope: layer index -> the model's rotary embedding of that layer (for pre-RoPE pipelines).
        sliding: per layer, whether it attends through a sliding window.
        simulated: new tokens are stored before they are attended to, so queries read every token in
            its compressed form (how papers report "simulated quantization" perplexity; use with
            residual 0 and no sinks).
        prefill_kernel: multi-token attention kernel, one of `attention.PREFILL_KERNELS`.
    """

    def __init__(
        self,
        pipeline: KVPipeline,
        num_layers: int,
        rope: Callable[[int], RopeFn] | None = None,
        sliding: list[bool] | None = None,
        simulated: bool = False,
        prefill_kernel: str = "auto",
    ):
        if prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel={prefill_kernel!r}; allowed: {PREFILL_KERNELS}")
        sliding = sliding or [False] * num_layers
        cross_layer = CrossLayer(num_layers) if pipeline.carries else None
        layers = [
            TorchKVLayer(pipeline, i, None if rope is None else rope(i), sliding[i], simulated, prefill_kernel, cross_layer)
            for i in range(num_layers)
        ]
        super().__init__(layers=layers)
        self.pipeline = pipeline

    def nbytes(self) -> int:
        """Bytes of storage of every tensor held by every layer."""
        return sum(layer.store.nbytes() for layer in self.layers)

    def encoded_bits_per_value(self) -> float:
        """Stored bits per encoded key or value over all layers, metadata included."""
        stores = [layer.store for layer in self.layers if layer.store.n_encoded]
        if not stores:
            return float("nan")
        bits = sum(s.encoded_bits_per_value() * s.n_encoded for s in stores)
        return bits / sum(s.n_encoded for s in stores)
