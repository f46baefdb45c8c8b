"""The attention function and mask function torchkv registers with transformers.

The mask function does not build a mask: it returns a `MaskSpec` (the model's mask rule plus the
padding mask and query offset), from which the attention function builds a FlexAttention `BlockMask`
for prefill or a small dense mask for decode, over the absolute positions of the cached tokens.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

from torchkv.ops.attention import QUERY_BLOCK, attend_dense, block_mask_from, flex_prefill, sdpa_by_query_blocks

ATTENTION_NAME = "torchkv"


@dataclass(frozen=True)
class MaskSpec:
    """The attention mask of one forward pass, in absolute token positions.

    Attributes:
        rule: transformers' mask function `(b, h, q_pos, kv_pos) -> bool` (causal, sliding, ...).
        padding: [B, kv_length] bool, False at padding, or None when nothing is padded.
        q_offset: absolute position index of the first query.
        kv_start: absolute index of the first key the attention reads (`after`): a sliding-window layer's store
            drops the tokens before it.
    """

    rule: Callable
    padding: torch.Tensor | None
    q_offset: "int | torch.Tensor"  # a 0-d tensor only inside a compiled step (read by no compiled path)
    _dense: dict = field(default_factory=dict, compare=False, repr=False)  # every layer asks for the same
    kv_start: int = 0
    #: transformers passes a prepared mask of 4 dimensions through its mask creation unchanged; a spec made
    #: outside a compiled step (by `generate`, for compileable caches) reaches the attention function the same way
    ndim: ClassVar[int] = 4

    @property
    def causal(self) -> bool:
        """The plain causal rule with no padding (what `is_causal` kernels implement)."""
        return self.rule is causal_mask_function and self.padding is None and not self.kv_start

    def after(self, dropped: int) -> "MaskSpec":
        """This spec over keys from absolute index `dropped` on (a store that dropped its first tokens); it shares
        the dense masks every layer asks for."""
        return self if not dropped else MaskSpec(self.rule, self.padding, self.q_offset, self._dense, dropped)

    @property
    def extra_rule(self) -> Callable | None:
        """The mask rule, or None for the plain causal one (under which every held token is visible to a new one)."""
        return None if self.rule is causal_mask_function else self.rule

    def dense(self, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
        """[B or 1, 1, Q, N] bool, by broadcasting the rule over index grids (computed once per forward)."""
        key = (q_len, kv_len, str(device), self.kv_start)
        if key not in self._dense:
            q = torch.arange(self.q_offset, self.q_offset + q_len, device=device)[None, None, :, None]
            kv = torch.arange(self.kv_start, self.kv_start + kv_len, device=device)[None, None, None, :]
            batch = 1 if self.padding is None else self.padding.shape[0]
            b = torch.arange(batch, device=device)[:, None, None, None]
            allowed = self.rule(b, torch.zeros_like(b), q, kv)
            if self.padding is not None:
                allowed = allowed & self.padding[:, None, None, self.kv_start : self.kv_start + kv_len]
            self._dense[key] = allowed.expand(batch, 1, q_len, kv_len)
        return self._dense[key]

    def mask_mod(self, device: torch.device, q_start: int = 0, kv_start: int = 0, padded: bool = False) -> Callable:
        """A FlexAttention mask_mod for queries from index `q_start` and keys from index `kv_start` (both counted from
        the first query and the first key read, `self.kv_start`).

        With `padded`, keys are also checked against the padding mask (indexed by batch row).
        """
        # tensors, so new offsets do not recompile
        q_off = torch.tensor(self.q_offset + q_start, device=device)
        kv_off = torch.tensor(self.kv_start + kv_start, device=device)
        rule, padding = self.rule, self.padding

        if not padded:

            def cached_causal(b, h, q_idx, kv_idx):
                return rule(b, h, q_idx + q_off, kv_idx + kv_off)

            return cached_causal

        def cached_causal_padded(b, h, q_idx, kv_idx):
            return rule(b, h, q_idx + q_off, kv_idx + kv_off) & padding[b, kv_idx + kv_off]

        return cached_causal_padded

    def left_padding(self) -> list[int] | None:
        """Pad count of each row when every row is pads then tokens (left padding), else None."""
        if self.padding is None:
            raise ValueError("no padding")
        starts = self.padding.int().argmax(-1)
        rows = torch.arange(self.padding.shape[-1], device=self.padding.device)[None]
        is_left = torch.equal(self.padding, rows >= starts[:, None])
        return starts.tolist() if is_left else None

    def trailing_padding(self, kv_len: int) -> list[int] | None:
        """Pad count after each row's last real token among the first `kv_len` positions (right-padded queries, as
        the lm-eval scorer's continuations), or None when no row has any."""
        if self.padding is None or torch.compiler.is_compiling():
            return None
        key = ("trailing", kv_len, self.kv_start)
        if key not in self._dense:  # every layer asks the same
            after = self.padding[:, self.kv_start : self.kv_start + kv_len].flip(-1).int().cummax(-1).values == 0
            self._dense[key] = after.sum(-1).tolist() if bool(after.any()) else None
        return self._dense[key]

    def check_storable(self, q_len: int, fresh: bool) -> None:
        """Refuse padding a torchkv cache cannot hold as each row would be held alone: a row that is all padding,
        padding between real tokens, or (on a `fresh` cache) padding after a row's tokens. Checked once per spec."""
        if self.padding is None or "checked" in self._dense:
            return
        self._dense["checked"] = True
        real = self.padding[:, : int(self.q_offset) + q_len]
        empty = (~real.any(-1)).nonzero()[:, 0].tolist()
        if empty:
            raise ValueError(f"row(s) {empty} of the attention mask are all padding: a torchkv cache holds each row's "
                             "own tokens and these have none; remove them from the batch")
        started = real.int().cummax(-1).values.bool()  # from each row's first real token on
        pads_after = started & ~real
        holes = pads_after & real.flip(-1).int().cummax(-1).values.flip(-1).bool()  # before a later real token
        if holes.any() or (fresh and pads_after.any()):
            rows = (holes.any(-1) | pads_after.any(-1)).nonzero()[:, 0].tolist()
            raise ValueError(
                f"row(s) {rows} of the attention mask have padding after real tokens ("
                f"{'padding between tokens' if holes.any() else 'right padding'}); torchkv caches take left-padded "
                "batches, pads first then each row's tokens: pad on the left (tokenizer.padding_side = 'left')")

    def for_rows(self, rows: torch.Tensor, strip: int, first_query: int) -> "MaskSpec":
        """The spec of the queries from `first_query` on of batch rows `rows`, in positions that start after the
        rows' first `strip` (the rule is shift-invariant: causal or sliding)."""
        padding = None if self.padding is None else self.padding[rows.to(self.padding.device), strip:]
        return MaskSpec(self.rule, padding, self.q_offset + first_query - strip)

    def valid(self, start: int, end: int) -> torch.Tensor | None:
        """[B, end - start] bool validity of the tokens at positions [start, end), or None."""
        return None if self.padding is None else self.padding[:, start:end]


def torchkv_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> MaskSpec:
    """The function registered with `AttentionMaskInterface`: returns the mask's description.

    Inside a compiled step nothing reads tensor values: the padding mask is kept even when it masks nothing, and
    a tensor `q_offset` (compileable caches report their length as one) stays a tensor."""
    if isinstance(attention_mask, MaskSpec):  # made before the compiled step (see `MaskSpec.ndim`)
        return attention_mask
    if kv_offset:
        raise ValueError("torchkv caches give masks over absolute token indices (a store that dropped tokens reads "
                         "its part); a non-zero kv_offset means a foreign cache layer")
    compiling = torch.compiler.is_compiling()
    if not (compiling and isinstance(q_offset, torch.Tensor)):
        q_offset = int(q_offset)
        if q_offset + q_length > kv_length:  # only a fixed-capacity cache reports fewer
            raise ValueError(
                f"the cache holds at most {kv_length} tokens (max_cache_len) and would hold {q_offset + q_length}: "
                "create it with a larger max_cache_len (generate sizes it from max_new_tokens with "
                "cache_implementation='static')"
            )
    padding = None
    if attention_mask is not None and (compiling or not bool(attention_mask.all())):
        # positions past the mask are tokens still to come
        padding = F.pad(attention_mask, (0, max(0, kv_length - attention_mask.shape[-1])), value=True)
    return MaskSpec(mask_function, padding, q_offset)


def _flex(query, keys, values, spec: MaskSpec, scaling: float, softcap: float | None):
    """Prompt attention with FlexAttention; left-padded rows run one by one over their own tokens."""
    q_len, kv_len = query.shape[2], keys.shape[2]
    device = query.device
    if spec.padding is None:
        block_mask = block_mask_from(spec.mask_mod(device), None, q_len, kv_len, device)
        return flex_prefill(query, keys, values, block_mask, scaling, softcap)
    starts = spec.left_padding()
    if starts is None:  # padding inside the sequence: one graph per shape
        block_mask = block_mask_from(spec.mask_mod(device, padded=True), query.shape[0], q_len, kv_len, device)
        return flex_prefill(query, keys, values, block_mask, scaling, softcap, dynamic=False)
    out = torch.zeros_like(query)
    for b, start in enumerate(starts):
        first_query, first_key = max(0, start - spec.q_offset), max(0, start - spec.kv_start)
        if first_key >= kv_len or first_query >= q_len:
            continue
        rows = q_len - first_query
        block_mask = block_mask_from(spec.mask_mod(device, first_query, first_key), None, rows, kv_len - first_key,
                                     device)
        out[b : b + 1, :, first_query:] = flex_prefill(
            query[b : b + 1, :, first_query:], keys[b : b + 1, :, first_key:], values[b : b + 1, :, first_key:],
            block_mask, scaling, softcap,
        )
    return out


def _sdpa(query, keys, values, spec: MaskSpec, scaling: float):
    """Prompt attention with SDPA: `is_causal` for a fresh causal prompt (row by row when left-padded),
    else the mask made dense: by query blocks, each over the keys it may see, or row by row up to each row's last
    real token when rows end in padding. Rows with nothing to attend to (padding) come out as zeros."""
    q_len, kv_len = query.shape[2], keys.shape[2]
    gqa = query.shape[1] != keys.shape[1]
    fresh_causal = spec.rule is causal_mask_function and q_len == kv_len and not spec.kv_start
    if fresh_causal and spec.padding is None:
        return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling, enable_gqa=gqa)
    starts = spec.left_padding() if fresh_causal else None
    if starts is not None:
        out = torch.zeros_like(query)
        for b, start in enumerate(starts):
            if start < kv_len:
                out[b : b + 1, :, start:] = F.scaled_dot_product_attention(
                    query[b : b + 1, :, start:], keys[b : b + 1, :, start:], values[b : b + 1, :, start:],
                    is_causal=True, scale=scaling, enable_gqa=gqa,
                )
        return out
    mask = spec.dense(q_len, kv_len, query.device)
    keys, values, gqa = _heads_for_masked_sdpa(query, keys, values)
    trailing = spec.trailing_padding(kv_len)
    if trailing is None:
        return sdpa_by_query_blocks(query, keys, values, mask, scaling, gqa)
    out = torch.zeros_like(query)  # each row over its tokens up to its last real one (as alone, bit for bit)
    for b, pads in enumerate(trailing):
        q, n = q_len - pads, kv_len - pads
        if q > 0:
            out[b : b + 1, :, :q] = F.scaled_dot_product_attention(
                query[b : b + 1, :, :q], keys[b : b + 1, :, :n], values[b : b + 1, :, :n],
                attn_mask=mask[b : b + 1, :, :q, :n], scale=scaling, enable_gqa=gqa,
            ).nan_to_num(0.0)
    return out


def transformers_sdpa_by_query_blocks(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (an `AttentionInterface` function, with SDPA's masks) for the models' own caches,
    computing a masked prompt by query blocks (`sdpa_by_query_blocks`): the same scores without the tiles that a
    sliding window masks, which SDPA computes (at 16K tokens of Gemma 3 on 2 CPU cores, minutes a prompt)."""
    if attention_mask is None or attention_mask.dtype != torch.bool or query.shape[2] <= QUERY_BLOCK or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    mask = attention_mask[..., : key.shape[2]]  # as transformers' SDPA reads it
    key, value, gqa = _heads_for_masked_sdpa(query, key, value)
    out = sdpa_by_query_blocks(query, key, value, mask, scaling, gqa)
    return out.transpose(1, 2).contiguous(), None


def _heads_for_masked_sdpa(query, keys, values) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(keys, values, enable_gqa) for SDPA with a mask: on CUDA the KV heads repeated to the query heads
    (`grouped_as_query_heads`), elsewhere as they are with `enable_gqa` where the head counts differ."""
    gqa = query.shape[1] != keys.shape[1]
    if gqa and query.is_cuda:
        return grouped_as_query_heads(keys, query.shape[1]), grouped_as_query_heads(values, query.shape[1]), False
    return keys, values, gqa


def grouped_as_query_heads(x: torch.Tensor, query_heads: int) -> torch.Tensor:
    """[B, H, N, D] -> [B, query_heads, N, D], KV head h serving query heads h*g .. h*g + g - 1 (`enable_gqa`'s
    grouping). On CUDA, SDPA with a mask and `enable_gqa` has no fused kernel and falls back to its math kernel, which
    forms the [B, Hq, Q, N] scores (at a 4K chunk over 12K cached tokens of a 1B Llama: 1.8 s against 0.28 s for
    transformers' prefill, which repeats KV heads like this); with the heads repeated it runs the memory-efficient one."""
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, query_heads // h, n, d).reshape(b, query_heads, n, d)


def _attend(query, keys, values, spec: MaskSpec, scaling: float, softcap: float | None, kernel: str = "auto"):
    """Attention of `query` [B, Hq, Q, D] over `keys`/`values` [B, H, N, D] (the last Q are the queries' own)."""
    if query.shape[2] == 1:
        mask = spec.dense(1, keys.shape[2], query.device)
        return attend_dense(query, keys, values, mask, scaling, softcap)[0]
    if kernel == "auto":
        kernel = "sdpa"
    if kernel == "sdpa" and softcap is None:  # SDPA has no logit soft-capping
        return _sdpa(query, keys, values, spec, scaling)
    return _flex(query, keys, values, spec, scaling, softcap)


def _sparse(query, store, k_new, v_new, spec: MaskSpec, scaling: float, softcap: float | None):
    """Attention reading only the encoded chunks the pipeline's selector picks for these queries, then
    the full-precision tokens (sinks, window) and the new ones, under the model's mask (padding, sliding window)
    at the tokens' absolute positions."""
    selector = store.pipeline.selector
    prefix = f"k.{store.pipeline.keys.transforms.index(selector)}."
    own = {n[len(prefix) :]: t for n, t in store.prepared.items() if n.startswith(prefix)}
    tokens = selector.select(query, own, store.n_encoded, scaling)  # [B, H, K·c] among the encoded tokens
    k_sel, v_sel = store.gather_encoded(tokens)
    k_fp, v_fp = store.full_precision(k_new, v_new)
    keys, values = torch.cat([k_sel, k_fp], 2), torch.cat([v_sel, v_fp], 2)
    q_len, before = query.shape[2], keys.shape[2] - k_new.shape[2]
    if spec.causal:  # every held token is visible; the new ones causally among themselves
        mask = torch.ones(q_len, keys.shape[2], dtype=torch.bool, device=query.device)
        mask[:, before:] = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
        return attend_dense(query, keys, values, mask[None, None], scaling, softcap)[0]
    ordered = store.attention_order(spec.dense(q_len, store.length + q_len, query.device))  # encoded first
    b, h, n_enc = *tokens.shape[:2], store.n_encoded
    encoded = ordered[..., :n_enc].expand(b, h, q_len, n_enc)
    selected = encoded.gather(-1, tokens[:, :, None].expand(b, h, q_len, tokens.shape[-1]))  # [B, H, Q, K·c]
    rest = ordered[..., n_enc:].expand(b, h, q_len, -1)
    return attend_dense(query, keys, values, torch.cat([selected, rest], -1), scaling, softcap)[0]


def torchkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: MaskSpec | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered with `AttentionInterface`.

    `key`/`value` are the `TorchKVLayer` handles returned by the cache (or plain tensors when the
    model runs without a torchkv cache). New tokens attend to themselves in full precision and to the
    compressed history; they are committed to the store afterwards. A frozen layer (`TorchKVLayer.freeze`)
    decodes on its fixed-shape buffers; any other step runs on its `KVStore`, and freezes it again after.
    """
    from torchkv.models.cache import TorchKVLayer

    if module.training and dropout:
        raise NotImplementedError("torchkv attention is for inference; call model.eval() or unpatch for training")
    if not isinstance(attention_mask, MaskSpec):
        raise TypeError("torchkv attention needs the torchkv mask function; the model was not patched correctly")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if not isinstance(key, TorchKVLayer):
        out = _attend(query, key, value, attention_mask, scaling, softcap)
        return out.transpose(1, 2).contiguous(), None
    layer = key
    if query.shape[2] == 1 and layer.frozen_stores():  # fixed-shape buffers: one graph for every step
        out = _decode_frozen(layer, query, attention_mask, scaling, softcap, kwargs.get("position_ids"))
        return out.transpose(1, 2).contiguous(), None
    if not torch.compiler.is_compiling():
        attention_mask.check_storable(query.shape[2], fresh=not layer.get_seq_length() - layer.pending[0].shape[2])
    layer.thaw()
    if layer.row_groups is None and attention_mask.padding is not None and not layer.store.length:
        pads = attention_mask.left_padding()
        if pads is not None:
            layer.split_rows(pads)
    if layer.row_groups is not None:
        out = _attend_by_row_group(layer, query, attention_mask, scaling, softcap, kwargs.get("position_ids"))
    else:
        out = _attend_and_commit(layer, query, attention_mask, scaling, softcap, kwargs.get("position_ids"))
    layer.end_attention()
    return out.transpose(1, 2).contiguous(), None


def _decode_frozen(layer, query, attention_mask: MaskSpec, scaling: float, softcap: float | None,
                   position_ids: torch.Tensor | None) -> torch.Tensor:
    """One decode step on fixed-capacity buffers: the layer's own, or each row group's over its rows, with token
    indices counted after the group's `strip` (no Python count is read, so one graph serves every step):
    `[B, Hq, 1, D]`. `position_ids` `[B or 1, 1]`: the new token's, kept where the pipeline reads positions."""
    k_new, v_new, _ = layer.take_staged()
    padding, rule = attention_mask.padding, attention_mask.extra_rule
    if layer.row_groups is None:
        return layer.static.decode_step(query, k_new, v_new, padding, rule, scaling, softcap, position_ids)
    out = torch.zeros_like(query)
    for group in layer.row_groups:
        rows = group.rows.to(query.device)
        held = None if padding is None else padding[rows.to(padding.device), group.strip:]
        positions = position_ids
        if position_ids is not None and position_ids.shape[0] > 1:
            positions = position_ids[rows.to(position_ids.device)]
        out[rows] = group.layer.static.decode_step(query[rows], k_new[rows], v_new[rows], held, rule, scaling,
                                                   softcap, positions)
    return out


def _attend_by_row_group(layer, query, attention_mask: MaskSpec, scaling: float, softcap: float | None,
                         position_ids):
    """`_attend_and_commit` for each row group of a split layer over its own rows and tokens (the positions before
    the group's `strip` are padding, whose outputs stay zero): `[B, Hq, Q, D]`."""
    k_new, v_new, staged = layer.take_staged()
    start = int(attention_mask.q_offset)
    out = torch.zeros_like(query)
    for group in layer.row_groups:
        rows, cut = group.rows.to(query.device), max(0, group.strip - start)
        if cut >= query.shape[2]:
            continue
        group.layer.thaw()
        group.layer.update(k_new[rows, :, cut:], v_new[rows, :, cut:])
        if "x" in staged:
            group.layer.layer_input = staged["x"][rows, cut:]
        positions = None
        if position_ids is not None:
            positions = position_ids[rows if position_ids.shape[0] > 1 else slice(None), cut:]
        spec = attention_mask.for_rows(rows, group.strip, cut)
        out[rows, :, cut:] = _attend_and_commit(group.layer, query[rows, :, cut:], spec, scaling, softcap, positions)
        group.layer.freeze()
    layer.grouped_length = start + query.shape[2]
    return out


def _attend_and_commit(layer, query, attention_mask: MaskSpec, scaling: float, softcap: float | None, position_ids):
    """Attention of the staged tokens over a layer's `KVStore` and themselves, then their commit: `[B, Hq, Q, D]`."""
    kernel = layer.prefill_kernel
    store = layer.store
    k_new, v_new = layer.pending
    start = store.n_seen
    valid = attention_mask.valid(start, start + k_new.shape[2])
    attention_mask = attention_mask.after(store.dropped)  # keys from the first one held
    commit = (valid, position_ids, {"queries": query})
    compiled = store.pipeline.compile and store.pipeline.selector is None
    if query.shape[2] == 1 and store.n_encoded and compiled and not layer.simulated:
        mask = None if attention_mask.causal else attention_mask.dense(1, store.length + 1, query.device)
        k, v, staged = layer.take_staged()
        return store.decode_step(query, k, v, mask, scaling, softcap, valid=valid, positions=position_ids,
                                 inputs={"queries": query, **staged})
    if store.n_encoded and store.pipeline.selector is not None and not layer.simulated:
        out = _sparse(query, store, k_new, v_new, attention_mask, scaling, softcap)
        layer.commit(*commit)
        return out
    if layer.simulated:  # every token, the queries' own included, is read in its stored form
        layer.commit(*commit)
        keys, values = store.history()
        out = _attend(query, keys, values, attention_mask, scaling, softcap, kernel)
        return out
    if not store.length:
        out = _attend(query, k_new, v_new, attention_mask, scaling, softcap, kernel)
        layer.commit(*commit)
        return out
    k_old, v_old = store.history()
    keys, values = torch.cat([k_old, k_new], 2), torch.cat([v_old, v_new], 2)
    if store.pipeline.window is None or not store.pipeline.window.reads_attention:
        out = _attend(query, keys, values, attention_mask, scaling, softcap, kernel)
        layer.commit(*commit)
        return out
    # a window policy reads this step's own probabilities of the full-precision tokens
    mask = attention_mask.dense(query.shape[2], keys.shape[2], query.device)
    out, probs = attend_dense(query, keys, values, mask, scaling, softcap)
    probs = probs.mean((0, 1, 2))  # [Q, N], N in token order: sinks, encoded, window, new
    fp = torch.cat([probs[:, : store.n_sinks], probs[:, store.n_sinks + store.n_encoded :]], 1)
    layer.commit(*commit, attention=fp)
    return out


def register() -> None:
    """Make the 'torchkv' attention and mask functions known to transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, torchkv_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, torchkv_mask)
