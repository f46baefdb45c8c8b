"""Prompt attention over plain tensors under a `MaskSpec`: SDPA (by query blocks where the mask is not plain
causal) or FlexAttention (soft-capping, padding inside a sequence), and transformers' SDPA by query blocks for its own
caches."""

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function

from torchkv.models.mask import MaskSpec
from torchkv.ops.attention import QUERY_BLOCK, attend_dense, block_mask_from, flex_prefill, sdpa_by_query_blocks


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
    transformers' prefill, which repeats KV heads like this); with the heads repeated it runs the memory-efficient
    one."""
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, query_heads // h, n, d).reshape(b, query_heads, n, d)


def attend(query, keys, values, spec: MaskSpec, scaling: float, softcap: float | None, kernel: str = "auto"):
    """Attention of `query` [B, Hq, Q, D] over `keys`/`values` [B, H, N, D] (the last Q are the queries' own)."""
    if query.shape[2] == 1:
        mask = spec.dense(1, keys.shape[2], query.device)
        return attend_dense(query, keys, values, mask, scaling, softcap)[0]
    if kernel == "auto":
        kernel = "sdpa"
    if kernel == "sdpa" and softcap is None:  # SDPA has no logit soft-capping
        return _sdpa(query, keys, values, spec, scaling)
    return _flex(query, keys, values, spec, scaling, softcap)
