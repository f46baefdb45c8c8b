"""The attention function torchkv registers with transformers: it hands a step's queries to the layer's store
(decode over the stored form, or a prompt over the rebuilt history) under the `MaskSpec` of `models/mask.py`."""

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from torchkv.models.mask import MaskSpec, torchkv_mask
from torchkv.models.prompt_attention import attend
from torchkv.ops.attention import attend_dense, with_score_bias

ATTENTION_NAME = "torchkv"


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
    dim, noise = query.shape[-1], store.history_noise(query)
    if noise is not None:  # the selected tokens' noise, then none for the full-precision ones
        norms, held = noise
        selected = held[..., store.n_sinks : store.n_sinks + store.n_encoded].gather(2, tokens)
        noise = torch.cat([selected, held.new_zeros(*held.shape[:2], keys.shape[2] - tokens.shape[2])], 2)
        query, keys, values = with_score_bias(query, keys, values, norms, noise, scaling)
    if spec.causal:  # every held token is visible; the new ones causally among themselves
        mask = torch.ones(q_len, keys.shape[2], dtype=torch.bool, device=query.device)
        mask[:, before:] = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
        return attend_dense(query, keys, values, mask[None, None], scaling, softcap)[0][..., :dim]
    ordered = store.attention_order(spec.dense(q_len, store.length + q_len, query.device))  # encoded first
    b, h, n_enc = *tokens.shape[:2], store.n_encoded
    encoded = ordered[..., :n_enc].expand(b, h, q_len, n_enc)
    selected = encoded.gather(-1, tokens[:, :, None].expand(b, h, q_len, tokens.shape[-1]))  # [B, H, Q, K·c]
    rest = ordered[..., n_enc:].expand(b, h, q_len, -1)
    return attend_dense(query, keys, values, torch.cat([selected, rest], -1), scaling, softcap)[0][..., :dim]


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
        out = attend(query, key, value, attention_mask, scaling, softcap)
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
        query, keys, values, dim = _corrected(store, query, keys, values, scaling)
        return attend(query, keys, values, attention_mask, scaling, softcap, kernel)[..., :dim]
    if not store.length:
        out = attend(query, k_new, v_new, attention_mask, scaling, softcap, kernel)
        layer.commit(*commit)
        return out
    k_old, v_old = store.history()
    keys, values = torch.cat([k_old, k_new], 2), torch.cat([v_old, v_new], 2)
    query, keys, values, dim = _corrected(store, query, keys, values, scaling)
    if store.pipeline.window is None or not store.pipeline.window.reads_attention:
        out = attend(query, keys, values, attention_mask, scaling, softcap, kernel)[..., :dim]
        layer.commit(*commit)
        return out
    # a window policy reads this step's own probabilities of the full-precision tokens
    mask = attention_mask.dense(query.shape[2], keys.shape[2], query.device)
    out, probs = attend_dense(query, keys, values, mask, scaling, softcap)
    out = out[..., :dim]
    probs = probs.mean((0, 1, 2))  # [Q, N], N in token order: sinks, encoded, window, new
    fp = torch.cat([probs[:, : store.n_sinks], probs[:, store.n_sinks + store.n_encoded :]], 1)
    layer.commit(*commit, attention=fp)
    return out


def _corrected(store, query, keys, values, scaling: float):
    """`(query, keys, values, D)`: as given, or widened (`with_score_bias`) where the pipeline corrects the held
    tokens' scores for their codes' noise (`KVStore.history_noise`); attention's output is its first D features.
    `keys`/`values` [B, H, N, D] are the store's history, then any new tokens (no noise)."""
    dim, noise = query.shape[-1], store.history_noise(query)
    if noise is None:
        return query, keys, values, dim
    norms, held = noise
    held = torch.cat([held, held.new_zeros(*held.shape[:2], keys.shape[2] - held.shape[2])], 2)
    return *with_score_bias(query, keys, values, norms, held, scaling), dim


def register() -> None:
    """Make the 'torchkv' attention and mask functions known to transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, torchkv_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, torchkv_mask)
