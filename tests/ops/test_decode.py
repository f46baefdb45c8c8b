"""Decode attention over packed codes equals attention over the reconstructed keys and values."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from torchkv.ops import GRIDS, dequantize, load_grid, pack_bits, quantize
from torchkv.ops.decode import (
    affine_scores,
    affine_weighted_sum,
    code_planes,
    grid_scores,
    grid_weighted_sum,
    token_weighted_reduction,
)
from torchkv.pipeline import COMPILE_OPTIONS


def _by_chunk(t: torch.Tensor, chunks: int) -> torch.Tensor:
    return t.unflatten(2, (chunks, t.shape[2] // chunks))


@given(
    bits=st.sampled_from([1, 2, 4, 8]),
    axis=st.sampled_from(["channel", "token"]),
    symmetric=st.booleans(),
    dim=st.sampled_from([64, 32, 48]),
    chunks=st.integers(1, 4),
    g=st.sampled_from([1, 3]),
    seed=st.integers(0, 1000),
)
def test_scores_and_weighted_sums_match_reconstruction(bits, axis, symmetric, dim, chunks, g, seed):
    gen = torch.Generator().manual_seed(seed)
    b, h, chunk, group = 2, 3, 32, 16
    x = torch.randn(b, h, chunks * chunk, dim, generator=gen)
    qdim = -2 if axis == "channel" else -1
    codes, scale, zero = quantize(x, bits, qdim, group, symmetric)
    xhat = dequantize(codes, scale, zero, bits, qdim, group)
    planes = code_planes(_by_chunk(pack_bits(codes, bits), chunks), bits)
    scale_c = _by_chunk(scale, chunks)
    zero_c = None if zero is None else _by_chunk(zero, chunks)
    q = torch.randn(b, h, g, dim, generator=gen)
    scores = affine_scores(q, planes, scale_c, zero_c, bits, axis)
    expected = torch.einsum("bhgd,bhtd->bhgt", q, xhat)
    torch.testing.assert_close(scores.flatten(-2), expected, rtol=1e-4, atol=1e-4)
    p = torch.softmax(expected, -1)
    out = affine_weighted_sum(p.unflatten(-1, (chunks, chunk)), planes, scale_c, zero_c, bits, axis, dim)
    expected = torch.einsum("bhgt,bhtd->bhgd", p, xhat)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    if axis == "token":  # on CPU a GEMM; what a GPU runs instead
        out = token_weighted_reduction(p.unflatten(-1, (chunks, chunk)), planes, scale_c, zero_c, bits, dim)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@given(
    bits=st.sampled_from([1, 2, 4, 8]),
    symmetric=st.booleans(),
    dim=st.sampled_from([64, 96, 192]),
    heads=st.integers(1, 3),
    chunks=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_a_latent_shared_by_every_head_sums_as_its_reconstruction(bits, symmetric, dim, heads, chunks, seed):
    """XQuant's value latent: one per-token-quantized row `[B, 1, T, r]` summed by the query rows of every head."""
    gen = torch.Generator().manual_seed(seed)
    b, g, chunk = 2, 3, 16
    x = torch.randn(b, 1, chunks * chunk, dim, generator=gen)
    codes, scale, zero = quantize(x, bits, -1, 32, symmetric)
    xhat = dequantize(codes, scale, zero, bits, -1, 32)
    planes = code_planes(_by_chunk(pack_bits(codes, bits), chunks), bits)
    p = torch.softmax(torch.randn(b, heads, g, chunks * chunk, generator=gen), -1)
    out = affine_weighted_sum(p.unflatten(-1, (chunks, chunk)), planes, _by_chunk(scale, chunks),
                              None if zero is None else _by_chunk(zero, chunks), bits, "token", dim)
    torch.testing.assert_close(out, torch.einsum("bhgt,btd->bhgd", p, xhat[:, 0]), rtol=1e-4, atol=1e-5)


@given(
    shape=st.sampled_from(GRIDS),
    dim=st.sampled_from([64, 32, 256]),
    heads=st.sampled_from([1, 3]),
    shared_scale=st.booleans(),
    chunks=st.integers(1, 4),
    g=st.sampled_from([1, 3]),
    seed=st.integers(0, 1000),
)
def test_grid_codes_score_and_sum_as_the_points_they_index(shape, dim, heads, shared_scale, chunks, g, seed):
    """Vector codes: `grid_scores`/`grid_weighted_sum` equal products with the rows `m_t·grid[c_t]` rebuilt densely."""
    d, n = shape
    gen = torch.Generator().manual_seed(seed)
    grid = load_grid(n, d)
    b, chunk = 2, 8
    codes = torch.randint(0, n, (b, heads, chunks * chunk, dim // d), generator=gen).to(torch.uint8)
    scale = torch.rand(b, 1 if shared_scale else heads, chunks * chunk, 1, generator=gen)
    rows = grid[codes.long()].flatten(-2) * scale  # [B, H, T, dim]
    q = torch.randn(b, heads, g, dim, generator=gen)
    scores = grid_scores(q, _by_chunk(codes, chunks), _by_chunk(scale, chunks), grid)
    expected = torch.einsum("bhgd,bhtd->bhgt", q, rows)
    torch.testing.assert_close(scores.flatten(-2), expected, rtol=1e-4, atol=1e-4)
    p = torch.softmax(expected, -1)
    out = grid_weighted_sum(p.unflatten(-1, (chunks, chunk)), _by_chunk(codes, chunks), _by_chunk(scale, chunks), grid)
    torch.testing.assert_close(out, torch.einsum("bhgt,bhtd->bhgd", p, rows), rtol=1e-4, atol=1e-5)


def test_compiled_kernel_equals_eager_with_a_dynamic_chunk_axis():
    torch.compiler.reset()

    def attend(q, packed, scale, zero):
        return affine_scores(q, code_planes(packed, 2), scale, zero, 2, "channel")

    compiled = torch.compile(attend, fullgraph=True, dynamic=False, options=COMPILE_OPTIONS)
    gen = torch.Generator().manual_seed(0)
    for chunks in (2, 3, 7):
        x = torch.randn(1, 3, 32 * chunks, 64, generator=gen)
        codes, scale, zero = quantize(x, 2, -2, 32)
        args = (torch.randn(1, 3, 3, 64, generator=gen), _by_chunk(pack_bits(codes, 2), chunks),
                _by_chunk(scale, chunks), _by_chunk(zero, chunks))
        for t in args[1:]:
            torch._dynamo.maybe_mark_dynamic(t, 2)
        expected = attend(*args)
        # Inductor sums the 64 products in another order: allow 16 float32 ulps of the largest score, no more.
        ulps = 16 * torch.finfo(torch.float32).eps * expected.abs().max().item()
        torch.testing.assert_close(compiled(*args), expected, rtol=0, atol=ulps)
