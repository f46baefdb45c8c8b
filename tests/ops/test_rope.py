import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from torchkv.ops import apply_rope, turned_dot, turned_dot_by_chunk
from torchkv.testing import llama_rope


def _cos_sin(positions, dim, scale=1.0):
    """Llama tables of `positions: [B, T]`, both multiplied by `scale` (as YaRN's attention factor does)."""
    return tuple(scale * t for t in llama_rope(positions, dim))


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


def _turned_dot_exact(q, x, positions, rotary, scale):
    """`q · R_t·x` in float64 from the angles themselves, with the rotated features scaled by `scale` as the tables
    scale them (the reference both float32 forms are held to), and the error bound of float32 angles:
    `|Δ| ≤ Σ_i |Δθ_i|·|q_pair_i|·|x_pair_i|` with `|Δθ_i| ≤ 2·2⁻²⁴·|t|·θ_i` (the angle `t·θ_i` rounded twice)."""
    inv = 1.0 / (10000 ** (torch.arange(0, rotary, 2).double() / rotary))
    angle = positions[..., None].double() * inv  # [B, T, R/2]
    h, q, x = rotary // 2, q.double(), x.double()
    q1, q2, x1, x2 = q[..., :h], q[..., h:rotary], x[..., :h], x[..., h:rotary]
    out = torch.einsum("bhgj,btj->bhgt", q1 * x1 + q2 * x2, angle.cos())
    out = out + torch.einsum("bhgj,btj->bhgt", q2 * x1 - q1 * x2, angle.sin())
    pairs = (q1**2 + q2**2).sqrt() * (x1**2 + x2**2).sqrt()  # [B, H, g, R/2]
    bound = 2 * 2.0**-24 * scale * torch.einsum("bhgj,btj->bhgt", pairs, angle.abs())
    return scale * out + (q[..., rotary:] * x[..., rotary:]).sum(-1, keepdim=True), bound


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), group=st.integers(1, 3), chunks=st.integers(0, 4),
       chunk=st.sampled_from([1, 4, 8]), rotary=st.sampled_from([8, 16]), start=st.integers(-70, 30000),
       scale=st.sampled_from([1.0, 1.3]), seed=st.integers(0, 2**16))
def test_turned_dot_by_chunk_is_turned_dot_over_chunks(batch, heads, group, chunks, chunk, rotary, start, scale,
                                                        seed):
    """Scores from the tables at each chunk's first position and at the steps within a chunk are those at every
    token's position: per-row starts, partial rotary, and tables that carry an attention scaling (YaRN's), which the
    step tables are divided by. Both float32 forms are held to the float64 scores within the error of float32 angles
    at that position (which `turned_dot` itself makes there) and of float32 sums."""
    g = torch.Generator().manual_seed(seed)
    q, x = torch.randn(batch, heads, group, 16, generator=g), torch.randn(batch, heads, 1, 16, generator=g)
    firsts = start + torch.randint(0, 3, (batch, 1), generator=g) + chunk * torch.arange(chunks)[None]  # [B, NC]
    positions = (firsts[..., None] + torch.arange(chunk)).flatten(1)  # [B, NC·C]
    cos, sin = _cos_sin(positions, rotary, scale)
    anchor_cos, anchor_sin = _cos_sin(firsts, rotary, scale)
    step_cos, step_sin = (t / scale for t in _cos_sin(torch.arange(chunk)[None], rotary, scale))
    got = turned_dot_by_chunk(q, x, anchor_cos, anchor_sin, step_cos, step_sin)
    exact, bound = _turned_dot_exact(q, x, positions, rotary, scale)
    assert got.shape == exact.shape == (batch, heads, group, chunks * chunk)
    for form in (got, turned_dot(q, x, cos, sin)):
        assert ((form.double() - exact).abs() <= 1e-5 + 2 * bound).all()
