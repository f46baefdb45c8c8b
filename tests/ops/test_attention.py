import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from transformers.masking_utils import sliding_window_causal_mask_function

from torchkv.models.mask import MaskSpec
from torchkv.models.prompt_attention import grouped_as_query_heads
from torchkv.ops.attention import attend_dense, block_mask_from, flex_prefill, sdpa_by_query_blocks


@pytest.mark.parametrize("hq,h", [(9, 3), (4, 4), (8, 1)])
def test_dense_matches_sdpa_with_gqa_and_mask(hq, h):
    q, k, v = torch.randn(2, hq, 3, 16), torch.randn(2, h, 20, 16), torch.randn(2, h, 20, 16)
    mask = torch.rand(2, 1, 3, 20) > 0.3
    mask[..., 0] = True
    out, probs = attend_dense(q, k, v, mask, scale=0.25)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=hq != h)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)))


def test_dense_fully_masked_row_is_zero_not_nan():
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out, _ = attend_dense(q, k, v, torch.zeros(1, 1, 1, 5, dtype=torch.bool), scale=1.0)
    assert torch.equal(out, torch.zeros_like(out))


def test_softcap_is_applied():
    q, k, v = torch.randn(1, 2, 1, 8) * 10, torch.randn(1, 2, 5, 8) * 10, torch.randn(1, 2, 5, 8)
    out, probs = attend_dense(q, k, v, None, scale=1.0, softcap=5.0)
    scores = 5.0 * torch.tanh((q @ k.transpose(-1, -2)) / 5.0)
    torch.testing.assert_close(probs[:, :, 0], torch.softmax(scores, -1))


@pytest.mark.parametrize("q_len,kv_len", [(16, 16), (20, 84)])
def test_flex_prefill_matches_sdpa(q_len, kv_len):
    q, k, v = torch.randn(2, 4, q_len, 32), torch.randn(2, 2, kv_len, 32), torch.randn(2, 2, kv_len, 32)
    offset = torch.tensor(kv_len - q_len)

    def causal(b, h, qi, ki):
        return ki <= qi + offset

    out = flex_prefill(q, k, v, block_mask_from(causal, None, q_len, kv_len, "cpu"), scale=0.2)
    mask = torch.arange(kv_len)[None] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_flex_prefill_keeps_each_sliding_window_a_constant():
    """Two models' sliding windows through one process's compiled FlexAttention, each at two prompt lengths (the
    second compiles symbolic lengths): a window that became a symbol once made the CPU template emit C++ that does
    not compile (torch 2.13, Gemma 2's soft-capping). Outputs match dense attention under the same rule."""
    for window in (40, 64):
        rule = sliding_window_causal_mask_function(window)
        for n in (150, 131):
            q, k, v = torch.randn(1, 4, n, 64), torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)
            spec = MaskSpec(rule, None, 0)
            out = flex_prefill(q, k, v, block_mask_from(spec.mask_mod("cpu"), None, n, n, "cpu"), 0.125, softcap=30.0)
            reference, _ = attend_dense(q, k, v, spec.dense(n, n, "cpu"), 0.125, softcap=30.0)
            torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(kv_heads=st.integers(1, 4), groups=st.integers(1, 4), n=st.integers(1, 9))
def test_heads_grouped_as_query_heads_match_enable_gqa(kv_heads, groups, n):
    """SDPA's masked path on CUDA repeats KV heads instead of `enable_gqa` (which has no fused kernel with a mask):
    the repeated heads give the same attention."""
    hq = kv_heads * groups
    q, k, v = torch.randn(2, hq, 3, 8), torch.randn(2, kv_heads, n, 8), torch.randn(2, kv_heads, n, 8)
    mask = torch.rand(2, 1, 3, n) > 0.3
    mask[..., 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = F.scaled_dot_product_attention(q, grouped_as_query_heads(k, hq), grouped_as_query_heads(v, hq), attn_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 90), block=st.integers(1, 40), window=st.integers(1, 50), kv_heads=st.sampled_from([1, 2]),
       pads=st.lists(st.integers(0, 30), min_size=2, max_size=2),
       rule=st.sampled_from(["sliding", "chunked", "causal"]))
def test_sdpa_by_query_blocks_equals_one_sdpa_call(n, block, window, kv_heads, pads, rule):
    """Prompt attention by query blocks, each over the span of keys its rows may see, gives one SDPA call's result
    under sliding-window, chunked and causal masks with left padding; rows that see no key are zeros."""
    q, k, v = torch.randn(2, 2 * kv_heads, n, 8), torch.randn(2, kv_heads, n, 8), torch.randn(2, kv_heads, n, 8)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    allowed = {"sliding": (j <= i) & (j > i - window), "chunked": (j <= i) & (j // window == i // window),
               "causal": j <= i}[rule]
    real = torch.arange(n)[None] >= torch.tensor(pads)[:, None]  # [2, n]
    mask = (allowed[None] & real[:, None, :])[:, None]  # [2, 1, n, n]
    out = sdpa_by_query_blocks(q, k, v, mask, 0.3, enable_gqa=kv_heads != q.shape[1], block=block)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=kv_heads != q.shape[1])
    torch.testing.assert_close(out, ref.nan_to_num(0.0), rtol=1e-5, atol=1e-5)
    blind = ~mask.any(-1, keepdim=True)  # [2, 1, n, 1]: rows that see no key
    assert not out.masked_select(blind).any()


def test_transformers_sdpa_by_query_blocks_matches_transformers_sdpa():
    """The attention that long-context evaluations give transformers' own caches: a 2,100-token prompt under a
    sliding window (3 query blocks) equals transformers' SDPA attention, and a maskless call is passed through."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from torchkv.models.prompt_attention import transformers_sdpa_by_query_blocks

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    n = 2100
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    rule = sliding_window_causal_mask_function(300)
    mask = rule(0, 0, torch.arange(n)[:, None], torch.arange(n)[None])[None, None]
    out, _ = transformers_sdpa_by_query_blocks(module, q, k, v, mask, scaling=0.25)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out, _ = transformers_sdpa_by_query_blocks(module, q, k, v, None, scaling=0.25)
    ref, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25)
    assert torch.equal(out, ref)
