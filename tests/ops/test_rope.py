import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from torchkv.ops import apply_rope, turned_dot


def _cos_sin(positions, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[..., None].float() * inv
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def test_matches_transformers_and_inverts():
    k = torch.randn(2, 3, 10, 64)
    cos, sin = _cos_sin(torch.arange(5, 15)[None].expand(2, 10), 64)
    _, expected = apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(apply_rope(k, cos, sin), expected)
    torch.testing.assert_close(apply_rope(apply_rope(k, cos, sin), cos, -sin), k, rtol=0, atol=1e-5)


def test_partial_rotary_leaves_the_rest():
    k = torch.randn(1, 2, 4, 64)
    cos, sin = _cos_sin(torch.arange(4)[None], 32)
    out = apply_rope(k, cos, sin)
    assert torch.equal(out[..., 32:], k[..., 32:])


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), group=st.integers(1, 3), tokens=st.integers(1, 9),
       rotary=st.sampled_from([8, 16]), start=st.integers(0, 5000), seed=st.integers(0, 2**16))
def test_turned_dot_is_the_score_of_the_turned_vector(batch, heads, group, tokens, rotary, start, seed):
    """`turned_dot` reads only the tables' first halves, and equals `q · apply_rope(x)` at every position, with
    partial rotary (R < D) and tables shared by the batch's rows or given per row."""
    g = torch.Generator().manual_seed(seed)
    q, x = torch.randn(batch, heads, group, 16, generator=g), torch.randn(batch, heads, 1, 16, generator=g)
    per_row = torch.arange(start, start + tokens)[None] + torch.arange(batch)[:, None]  # [B, T]
    for positions in (per_row, per_row[:1]):
        cos, sin = _cos_sin(positions, rotary)
        turned = apply_rope(x.expand(-1, -1, tokens, -1), cos, sin)  # [B, H, T, D]
        expected = torch.einsum("bhgd,bhtd->bhgt", q, turned)
        torch.testing.assert_close(turned_dot(q, x, cos, sin), expected, rtol=1e-4, atol=1e-4)
