"""Attention kernels over (reconstructed) caches: FlexAttention for prefill, a dense path for decode."""

import functools
import math
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from torchkv._compat import function_copy

#: kernels for prompt (multi-token) attention: FlexAttention with the model's mask_mod as a BlockMask, or
#: torch's SDPA with the same mask made dense (is_causal where it is plain causal). "auto" picks SDPA, and
#: FlexAttention only for soft-capping, which SDPA lacks: on CPU the compiled FlexAttention template measured
#: ~2.8x slower than SDPA's causal kernel at 4K tokens (torch 2.13), and on an H100 (torch 2.11) Inductor found no
#: FlexAttention decoding kernel for the chunks of a chunked prompt (NoValidChoicesError).
PREFILL_KERNELS = ("auto", "flex", "sdpa")


@functools.cache
def make_softcap_score_mod(cap: float) -> Callable:
    """score_mod for logit soft-capping (Gemma 2): `cap · tanh(score / cap)`."""
    # a tensor, not a Python float: dynamic compiles turn captured floats into symbols flex cannot lower
    cap_t = torch.tensor(cap)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap_t * torch.tanh(score / cap_t)

    softcap.__name__ = f"softcap_{cap:g}"
    return softcap


def rule_constants(fn: Callable) -> tuple:
    """The numbers a mask_mod's closures hold, through nested closures and tuples of functions: transformers'
    sliding window or chunk size inside torchkv's offset mask_mod."""
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, (bool, int, float)):
            found.append(value)
        for inner in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(inner, types.FunctionType):
                found.extend(rule_constants(inner))
    return tuple(found)


@functools.cache
def _compiled_flex(dynamic: bool, constants: tuple) -> Callable:
    # None: static first, then lengths that change become symbolic. One code object per mask_mod's constants: an
    # int that changes between compiles of one code object (a second model's sliding window) becomes symbolic too,
    # and the CPU template of torch 2.13 emits C++ that does not compile for a symbolic window
    fn = function_copy(flex_attention, "_".join(map(str, constants)) or "plain")
    return torch.compile(fn, dynamic=None if dynamic else False)


def flex_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    softcap: float | None = None,
    dynamic: bool = True,
) -> torch.Tensor:
    """Compiled FlexAttention with grouped-query heads.

    Args:
        q: [B, Hq, Q, D]. k, v: [B, H, N, D] with H dividing Hq.
        block_mask: mask over (Q, N) built with `create_block_mask`.
        dynamic: one graph for every length (after the first recompile). Pass False for a mask_mod that
            indexes a captured tensor by batch: the CPU template of torch 2.13 miscompiles that case
            with dynamic shapes.

    Returns:
        [B, Hq, Q, D], q's dtype.
    """
    score_mod = None if softcap is None else make_softcap_score_mod(softcap)
    return _compiled_flex(dynamic, rule_constants(block_mask.mask_mod))(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


#: queries per SDPA call of `sdpa_by_query_blocks`
QUERY_BLOCK = 1024


def sdpa_by_query_blocks(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
    enable_gqa: bool = False, block: int = QUERY_BLOCK,
) -> torch.Tensor:
    """SDPA under a dense bool `mask`, `block` queries at a time, each block reading only the keys from the first to
    the last one that its rows may see.

    SDPA's kernels compute every tile of a masked score matrix, so a sliding window of W tokens over a Q-token prompt
    costs Q² scores in one call; by blocks it costs about Q·(block + W). A masked key adds nothing to a row, so the
    result is the one call's up to rounding. Rows that may see no key come out as zeros. Inside a compiled graph, where
    the spans would depend on the mask's values, it is the one call.

    Args:
        query: [B, Hq, Q, D]. keys, values: [B, H, N, D].
        mask: [B or 1, 1, Q, N] bool, True where a query may see a key.

    Returns:
        [B, Hq, Q, D].
    """
    if torch.compiler.is_compiling():
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=enable_gqa).nan_to_num(0.0)
    out = torch.zeros_like(query)
    for start in range(0, query.shape[2], block):
        rows = mask[:, :, start : start + block]
        seen = rows.any(2).flatten(0, 1).any(0).nonzero()  # keys any row of the block sees, with no copy of the rows
        if not seen.numel():
            continue
        lo, hi = int(seen[0]), int(seen[-1]) + 1
        out[:, :, start : start + block] = F.scaled_dot_product_attention(
            query[:, :, start : start + block], keys[:, :, lo:hi], values[:, :, lo:hi], attn_mask=rows[..., lo:hi],
            scale=scale, enable_gqa=enable_gqa,
        ).nan_to_num(0.0)
    return out


#: features `with_score_bias` appends: a multiple of 8 keeps SDPA's fused kernels (the first one carries the bias)
BIAS_FEATURES = 8


def with_score_bias(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, norms: torch.Tensor,
                    noise: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, keys and values with `BIAS_FEATURES` features appended, so that attention at `scale` over them scores
    query i and key t as `scale·q_i·k_t − ½·scale²·norms_i·noise_t` (the score-noise correction of
    `HiggsQuantize.token_noise`: a rank-one bias, one feature of the query times one of the key) and returns the
    attention output in its first D features.

    Args:
        query: [B, Hq, Q, D]. keys, values: [B, H, N, D]. norms: [B, Hq, Q]. noise: [B, H, N].

    Returns:
        query, keys, values, each [..., D + BIAS_FEATURES].
    """
    def widened(x: torch.Tensor, first: torch.Tensor | None) -> torch.Tensor:
        extra = x.new_zeros(*x.shape[:-1], BIAS_FEATURES)
        if first is not None:
            extra[..., 0] = first
        return torch.cat([x, extra], -1)

    return widened(query, norms), widened(keys, noise * (-0.5 * scale)), widened(values, None)


def block_mask_from(mask_mod: Callable, batch: int | None, q_len: int, kv_len: int, device) -> BlockMask:
    """`create_block_mask` over one head (the mask is the same for every head)."""
    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)


def attend_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scale)·v with grouped-query heads, returning the probabilities too.

    Args:
        q: [B, Hq, Q, D]. k, v: [B, H, N, D] with Hq = g·H (query head j reads KV head j // g).
        mask: [B or 1, 1, Q, N] bool (True = attend), or None.

    Returns:
        out: [B, Hq, Q, D], q's dtype.
        probs: [B, H, g, Q, N] float32. Rows with no allowed key are all zero.
    """
    b, hq, nq, d = q.shape
    h, n = k.shape[1], k.shape[2]
    g = hq // h
    qg = q.reshape(b, h, g * nq, d)  # [B, H, g·Q, D]
    scores = (qg @ k.transpose(-1, -2)).float() * scale  # [B, H, g·Q, N]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(b, h, g, nq, n)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = probs.to(v.dtype).view(b, h, g * nq, n) @ v  # [B, H, g·Q, D]
    return out.view(b, hq, nq, d), probs
