"""The compressed Cache handed to Hugging Face models: one `TorchKVLayer` (a `CacheLayerMixin`) per layer.

`update` only stages the new keys and values and returns the layer itself as a handle; the attention
function registered by torchkv reads the handle, attends over the compressed history plus the new
tokens, and then commits the new tokens to the layer's `KVStore`.

With `max_cache_len`, layers whose pipeline allows it also hold a `StaticKVStore`: prompts still go through the
`KVStore`, whose tokens then move into fixed-capacity buffers ("frozen"), where each decode step runs as pure
tensor code. Such a cache `is_compileable`: a whole decode step (model and cache) compiles into one graph.
"""

import warnings
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from torchkv.ops.attention import PREFILL_KERNELS
from torchkv.pipeline import KVPipeline
from torchkv.positions import SharedRope
from torchkv.static_store import StaticKVStore, static_refusal
from torchkv.store import CrossLayer, KVStore, RopeFn


class RowGroup(NamedTuple):
    """Rows of a left-padded batch held by one layer of their own (`TorchKVLayer.split_rows`)."""

    rows: torch.Tensor  # [b] long: the batch rows, in the group layer's order
    strip: int  # leading tokens, padding in every one of these rows, that the group's layer does not hold
    layer: "TorchKVLayer"


class TorchKVLayer(CacheLayerMixin):
    """One layer's compressed cache, behind transformers' per-layer cache contract."""

    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        pipeline: KVPipeline,
        layer_idx: int,
        rope: RopeFn | None = None,
        sliding_window: int | None = None,
        simulated: bool = False,
        prefill_kernel: str = "auto",
        cross_layer: CrossLayer | None = None,
        max_cache_len: int | None = None,
        layers_after: int = 0,
        group_cross_layers: dict | None = None,
    ):
        super().__init__()
        # stores drop what the window passed, but simulated caches (whose queries attend after their tokens are
        # stored) hold every token
        window = None if simulated else sliding_window
        self.store = KVStore(pipeline, layer_idx, rope, cross_layer, window)
        self._settings = (pipeline, layer_idx, rope, sliding_window, simulated, prefill_kernel)
        #: a left-padded batch's rows in groups, each held by a layer of its own as its rows would be held alone
        #: (`split_rows`); None while the batch is held by `store`
        self.row_groups: list[RowGroup] | None = None
        self.grouped_length = 0  # positions the batch holds while split, pads included
        #: rows -> the CrossLayer their groups share across the cache's layers (cross-layer pipelines)
        self.group_cross_layers = {} if group_cross_layers is None else group_cross_layers
        #: fixed-capacity buffers, which hold the tokens while `frozen` (decode steps), or None
        self.static = None if max_cache_len is None else StaticKVStore(self.store.pipeline, max_cache_len,
                                                                        layers_after, rope, window)
        self.is_compileable = self.static is not None
        self.frozen = False
        self.is_sliding = sliding_window is not None
        self.simulated = simulated
        self.prefill_kernel = prefill_kernel
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        #: [B, T, d] the attention block's input for the staged tokens, when the pipeline reads it
        #: (set by the attention pre-hook `patch` installs)
        self.layer_input: torch.Tensor | None = None
        #: what the cache's layers shared during a step, released once this layer has attended (the cache's last)
        self.releases: list[SharedRope] = []

    def split_rows(self, pads: list[int]) -> None:
        """Hold a left-padded batch (`pads`: each row's pad count) in row groups whose tokens are counted from their
        rows' first real token: rows whose pads differ by whole chunks share a group (rows with equal pads, for
        pipelines with sinks; each row alone where a window policy averages attention over a group's rows), which
        drops the pads its rows share. Each row is then encoded as it would be alone (statistics ignore the pads that
        remain). With fixed capacity each group gets buffers of its own, sized for the tokens it holds. Only before the
        first token; nothing changes where it would not help (one group, no pad to drop)."""
        if self.store.length:
            return
        pipe, shared = self.store.pipeline, self.store.cross_layer
        alone = pipe.window is not None and pipe.window.reads_attention  # one decision per group (SubKV)
        keys: dict = {}
        for row, p in enumerate(pads):
            keys.setdefault(row if alone else p if pipe.sinks else p % pipe.chunk, []).append(row)
        if len(keys) == 1 and not min(pads):
            return
        pipeline, layer_idx, rope, sliding_window, simulated, kernel = self._settings
        self.row_groups = []
        for rows in keys.values():
            cross = None
            if shared is not None:
                cross = self.group_cross_layers.setdefault(tuple(rows), CrossLayer(shared.num_layers))
            strip = min(pads[r] for r in rows)
            capacity, after = (None, 0) if self.static is None else (self.static.capacity - strip,
                                                                     self.static.layers_after)
            layer = TorchKVLayer(pipeline, layer_idx, rope, sliding_window, simulated, kernel, cross, capacity, after)
            layer.is_initialized, layer.dtype, layer.device = True, self.dtype, self.device
            self.row_groups.append(RowGroup(torch.tensor(rows, device=self.device), strip, layer))

    def stores(self) -> list["KVStore | StaticKVStore"]:
        """The stores that hold the tokens: the layer's own, or each row group's."""
        return [self.held] if self.row_groups is None else [g.layer.held for g in self.row_groups]

    def frozen_stores(self) -> list[StaticKVStore] | None:
        """The fixed-capacity stores that hold every token (the layer's own, or one per row group), or None while
        some tokens are in a growing store."""
        layers = [self] if self.row_groups is None else [g.layer for g in self.row_groups]
        return [layer.static for layer in layers] if all(layer.frozen for layer in layers) else None

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

    def take_staged(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The staged keys and values `[B, H, T, D]` and the model-side tensors that go with them ({"x": the layer
        input} where the patch staged it), handed over: nothing is staged after."""
        (k, v), self.pending = self.pending, None
        inputs = {} if self.layer_input is None else {"x": self.layer_input}
        self.layer_input = None
        return k, v, inputs

    def commit(
        self, valid: torch.Tensor | None, positions: torch.Tensor | None, inputs: dict,
        attention: torch.Tensor | None = None,
    ) -> None:
        """Move the staged tokens into the store (called by the attention function after attending;
        `attention` as `KVStore.append` takes it)."""
        k, v, staged = self.take_staged()
        self.store.append(k, v, valid=valid, positions=positions, inputs={**inputs, **staged}, attention=attention)

    def end_attention(self) -> None:
        """After this layer's attention: freeze its tokens, and release what the cache's layers shared in the step
        when it is the last."""
        self.freeze()
        for shared in self.releases:
            shared.release()

    def freeze(self) -> None:
        """Move the store's tokens into the fixed-capacity buffers (after a prompt; eager), once it has prepared
        (`KVStore.awaits_prepare`: the buffers encode chunks with the prepared state)."""
        if self.static is not None and not self.frozen and self.store.length and not self.store.awaits_prepare:
            self.static.freeze(self.store)
            self.frozen = True

    def thaw(self) -> None:
        """Move the tokens back from the fixed-capacity buffers into the store (before a multi-token step; eager)."""
        if self.frozen:
            self.static.thaw(self.store)
            self.frozen = False

    @property
    def held(self) -> "KVStore | StaticKVStore":
        """Whichever store holds the tokens now."""
        return self.static if self.frozen else self.store

    def get_seq_length(self) -> "int | torch.Tensor":
        """Tokens held; a 0-d tensor while frozen (as transformers' static layers do), so that compiled steps
        do not specialise on it."""
        staged = 0 if self.pending is None else self.pending[0].shape[2]
        if self.row_groups is not None:
            group = self.row_groups[0]
            if group.layer.frozen:  # a 0-d tensor, as for the layer's own buffers
                return group.layer.static.buffers["length"] + group.strip + staged
            return self.grouped_length + staged
        if self.frozen:
            return self.static.buffers["length"] + staged
        return self.store.n_seen + staged

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # masks are over absolute kv indices; a store that dropped tokens reads its part (`MaskSpec.after`)
        if self.static is not None:
            return self.static.capacity, 0
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1 if self.static is None else self.static.capacity

    def reset(self) -> None:
        self.store.reset()
        self.frozen = False
        self.pending = self.layer_input = self.row_groups = None
        self.grouped_length = 0
        self.group_cross_layers.clear()

    def _edit(self, edit: Callable[[KVStore], None]) -> None:
        """Apply an edit to the store, with the tokens moved back into it for the edit if frozen."""
        frozen = self.frozen
        self.thaw()
        edit(self.store)
        if frozen:
            self.freeze()

    def _select_rows(self, select: torch.Tensor) -> None:
        """Make new row i the old row `select[i]` in every row group (beam search, repeated rows)."""
        groups = []
        for group in self.row_groups:
            member = select.to(group.rows.device)[:, None] == group.rows[None, :]  # [new rows, group rows]
            rows = member.any(1).nonzero()[:, 0]
            if len(rows):
                group.layer.reorder_cache(member[rows].int().argmax(1))
                groups.append(RowGroup(rows, group.strip, group.layer))
        self.row_groups = groups

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.row_groups is not None:
            return self._select_rows(torch.as_tensor(beam_idx))
        self._edit(lambda store: store.reorder(beam_idx))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers' negative-count convention)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number, the count of tokens to remove from the end"
            )
        for group in self.row_groups or []:
            group.layer.crop(tokens_to_remove)
        self.grouped_length = max(0, int(self.get_seq_length()) + tokens_to_remove)
        self._edit(lambda store: store.crop(-tokens_to_remove))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.row_groups is not None:
            return self._select_rows(torch.arange(sum(len(g.rows) for g in self.row_groups)).repeat_interleave(repeats))
        self._edit(lambda store: store.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(torch.as_tensor(indices))

    def __getattr__(self, name: str):
        # only reached for attributes a layer lacks: an attention function other than torchkv's reading the
        # handles `update` returns as if they were key/value tensors
        raise AttributeError(
            f"'{type(self).__name__}' has no attribute '{name}': a torchkv cache layer's update() returns handles "
            "that only torchkv's attention function reads; pass this cache only to the model torchkv.new_cache made "
            "it for, patched (torchkv.patch(model))"
        )

    def offload(self):
        raise NotImplementedError("torchkv caches are not offloaded; the compressed store stays on the layer's device")

    prefetch = offload


class TorchKVCache(Cache):
    """A `Cache` whose layers store keys and values compressed by a `KVPipeline`.

    Args:
        pipeline: the compression recipe.
        num_layers: decoder layers.
        rope: per layer, the model's rotary embedding of that layer (for pipelines that read positions); layers given
            the same function share their position ids and, within a step, their cos/sin (`SharedRope`).
        sliding: per layer, the sliding window it attends through (tokens), or None; the stores of such a layer
            drop the tokens the window has passed (fixed-capacity buffers keep the chunk slots the window reaches).
        simulated: new tokens are stored before they are attended to, so queries read every token in
            its compressed form (how papers report "simulated quantization" perplexity; use with
            residual 0 and no sinks).
        prefill_kernel: multi-token attention kernel, one of `ops.attention.PREFILL_KERNELS`.
        max_cache_len: the most tokens a layer will hold. Given, decode steps run on fixed-capacity buffers and
            the cache `is_compileable` (a pipeline that cannot says why, with a warning, and keeps growing stores).
        devices: per layer, the device its keys and values will be on (a model spread over devices), so that a
            layer's capacity check counts only the later layers on its device; None: one device.
    """

    def __init__(
        self,
        pipeline: KVPipeline,
        num_layers: int,
        rope: list[RopeFn] | None = None,
        sliding: list[int | None] | None = None,
        simulated: bool = False,
        prefill_kernel: str = "auto",
        max_cache_len: int | None = None,
        devices: list[torch.device] | None = None,
    ):
        if prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel={prefill_kernel!r}; allowed: {PREFILL_KERNELS}")
        sliding = sliding or [None] * num_layers
        cross_layer = CrossLayer(num_layers) if pipeline.carries else None
        group_cross_layers: dict = {}
        if max_cache_len is not None:
            reasons = {static_refusal(pipeline.for_layer(i)) for i in range(num_layers)} - {None}
            if simulated:
                reasons.add("simulated caches attend to every token after storing it")
            if reasons:
                warnings.warn(f"pipeline '{pipeline.name}' cannot decode on fixed-shape buffers (max_cache_len), so "
                              f"the whole decode step cannot be compiled: {'; '.join(sorted(reasons))}. It decodes with "
                              "per-layer compiled attention instead.", stacklevel=2)
                max_cache_len = None
        devices = devices or [None] * num_layers
        shared = {} if rope is None else {id(fn): SharedRope(fn) for fn in rope}
        layers = [
            TorchKVLayer(pipeline, i, None if rope is None else shared[id(rope[i])], sliding[i], simulated,
                         prefill_kernel, cross_layer, max_cache_len, devices[i + 1 :].count(devices[i]),
                         group_cross_layers)
            for i in range(num_layers)
        ]
        layers[-1].releases = list(shared.values())  # the last layer of a step forgets the step's cos/sin
        super().__init__(layers=layers)
        self.pipeline = pipeline
        #: the model `torchkv.new_cache` made this cache for (a weak reference), or None; a patched model refuses
        #: a cache made for another (`check_model`)
        self.model: weakref.ref | None = None

    def check_model(self, model) -> None:
        """Raise a clear error if this cache was made for another model than `model`."""
        owner = None if self.model is None else self.model()
        if owner is not None and owner is not model:
            raise ValueError(
                f"this torchkv cache was made for another model ({type(owner).__name__} at {id(owner):#x}, "
                f"{len(self.layers)} layers); a cache holds one model's keys and values: pass "
                "torchkv.new_cache(model) for this one (or nothing)"
            )

    @property
    def awaits_prepare(self) -> bool:
        """Some layer's store holds too few tokens to prepare its per-sequence state from (`KVStore.awaits_prepare`):
        it stays out of the fixed-capacity buffers, so a compiled step would not hold it."""
        return any(isinstance(store, KVStore) and store.awaits_prepare
                   for layer in self.layers if not layer.frozen for store in layer.stores())  # (a host check per step)

    def nbytes(self) -> int:
        """Bytes of storage of every tensor held by every layer, each storage once (layers share their position ids)."""
        storages = {(t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
                    for layer in self.layers for store in layer.stores() for t in store.tensors().values()}
        return sum(storages.values())

    def encoded_bits_per_value(self) -> float:
        """Stored bits per encoded key or value over all layers, metadata included."""
        stores = [store for layer in self.layers for store in layer.stores() if store.n_encoded]
        if not stores:
            return float("nan")
        bits = sum(s.encoded_bits_per_value() * s.n_encoded for s in stores)
        return bits / sum(s.n_encoded for s in stores)
