"""SQuat ops against the spec's §5 properties (specs/squat.md P1–P19)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchkv.ops import dequantize, quantize
from torchkv.ops.squat import block_updates, query_subspace, squat_quantize

# (D, g): T = D/g blocks of 1, 2 or 4, as in the paper (at most 4 blocks per key)
SHAPES = [(8, 8), (16, 8), (16, 4), (32, 16), (64, 32), (64, 16)]


def _queries(seed: int, rows: int, d: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # anisotropic, like real queries: a few dominant directions, in a random orientation
    spread = torch.logspace(0, -3, d, dtype=torch.float64)  # effective rank of a few, as prompt queries (SQuat Fig. 2)
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return scale * (torch.randn(rows, d, generator=g, dtype=torch.float64) * spread) @ rotation


def _p(qhat: torch.Tensor, lam: float) -> torch.Tensor:
    return torch.eye(qhat.shape[-1], dtype=torch.float64) + lam * qhat.T.double() @ qhat.double()


def _recursion_updates(qhat: torch.Tensor, lam: float, g: int) -> torch.Tensor:
    """SQuat Lemma 3 / Prop. 2: A_t⁻¹ from A_{t+1}⁻¹ by a Schur complement, then M_t = B_t·H_t (float64)."""
    d = qhat.shape[-1]
    p = _p(qhat, lam)
    p_inv = torch.linalg.inv(p)
    a_inv = {d // g: p}
    for t in range(d // g - 1, 0, -1):
        n, big = t * g, a_inv[t + 1]
        m, lower, o = big[:n, :n], big[n:, :n], big[n:, n:]
        a_inv[t] = m - lower.T @ torch.linalg.solve(o, lower)
    mats = [p_inv[t * g :, : t * g] @ a_inv[t][:, -g:] for t in range(1, d // g)]
    return torch.cat(mats, 0) if mats else torch.zeros(0, g, dtype=torch.float64)


def _rows_of(updates: torch.Tensor, d: int, g: int, t: int) -> torch.Tensor:
    """M_t (1-based t) out of the stacked `block_updates` output."""
    start = sum(d - s * g for s in range(1, t))
    return updates[..., start : start + d - t * g, :]


setup = st.tuples(
    st.sampled_from(SHAPES), st.integers(0, 8), st.floats(0, 10), st.integers(0, 2**16), st.integers(4, 48)
)


@given(setup)
def test_recursion_equals_closed_form(args):
    """P1/P2: the paper's recursion and the direct solve give the same update matrices."""
    (d, g), rank, lam, seed, rows = args
    qhat = query_subspace(_queries(seed, rows, d), rank)
    cond = float(torch.linalg.cond(_p(qhat, lam)))
    expected = _recursion_updates(qhat, lam, g)
    torch.testing.assert_close(block_updates(qhat, lam, g).double(), expected, rtol=1e-5, atol=1e-6 * cond)


@given(setup)
def test_each_update_is_the_constrained_minimiser(args):
    """P4 (KKT): with block t fixed at error d_t and earlier blocks frozen, δ = [0; d_t; M_t d_t] has
    (Pδ)[tg:] = 0, i.e. it minimises ‖δ‖² + λ‖Q̂δ‖² over the channels after block t."""
    (d, g), rank, lam, seed, rows = args
    qhat = query_subspace(_queries(seed, rows, d), rank)
    p = _p(qhat, lam)
    updates = block_updates(qhat, lam, g).double()
    error = torch.randn(g, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for t in range(1, d // g):
        delta = torch.zeros(d, dtype=torch.float64)
        delta[(t - 1) * g : t * g] = error
        delta[t * g :] = _rows_of(updates, d, g, t) @ error
        residual = (p @ delta)[t * g :]
        assert residual.norm() <= 1e-5 * p.norm() * delta.norm()


@given(st.sampled_from(SHAPES), st.integers(1, 6), st.integers(0, 2**16), st.integers(2, 40), st.integers(1, 12))
def test_subspace_is_the_top_of_the_query_gram_and_ignores_pads(shape, rank, seed, rows, pads):
    """Q̂ᵀQ̂ is the best rank-r approximation of QᵀQ; masked (pad) rows change nothing."""
    d, _ = shape
    q = _queries(seed, rows, d)
    u, s, vh = torch.linalg.svd(q, full_matrices=False)
    r = min(rank, s.numel())
    best = vh[:r].T @ torch.diag(s[:r] ** 2) @ vh[:r]
    qhat = query_subspace(q, rank)
    assert qhat.shape == (rank, d)
    torch.testing.assert_close(qhat.T @ qhat, best, rtol=1e-8, atol=1e-8 * float(s[0] ** 2))
    garbage = torch.cat([q, 1e3 * torch.randn(pads, d, dtype=torch.float64)])
    valid = torch.arange(rows + pads) < rows
    masked = query_subspace(garbage, rank, valid)
    torch.testing.assert_close(masked.T @ masked, best, rtol=1e-8, atol=1e-8 * float(s[0] ** 2))


@given(st.sampled_from(SHAPES), st.integers(1, 6), st.floats(0.01, 10), st.integers(0, 2**16))
def test_depends_on_the_subspace_only_through_its_gram(shape, rank, lam, seed):
    """P12: Q̂ → UQ̂ (U orthogonal, e.g. SVD sign flips) gives the same updates."""
    d, g = shape
    qhat = query_subspace(_queries(seed, 32, d), rank)
    u, _ = torch.linalg.qr(torch.randn(rank, rank, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    torch.testing.assert_close(block_updates(u @ qhat, lam, g), block_updates(qhat, lam, g), rtol=1e-4, atol=1e-5)


keys = st.tuples(
    st.sampled_from(SHAPES), st.sampled_from([1, 2, 3, 4]), st.sampled_from([8, 16, 32]), st.integers(1, 3),
    st.integers(0, 2**16),
)


def _keys(seed, groups, group, d, batch=2, heads=2):
    g = torch.Generator().manual_seed(seed)
    outliers = 1 + 8 * (torch.rand(d, generator=g) > 0.9)  # KIVI's outlier channels
    return torch.randn(batch, heads, groups * group, d, generator=g) * outliers


@given(keys, st.integers(0, 4))
def test_no_penalty_is_plain_per_channel_quantization(args, rank):
    """P8: λ = 0, or r = 0, gives bit-identical KIVI keys."""
    (d, g), bits, group, groups, seed = args
    x = _keys(seed, groups, group, d)
    q = torch.randn(2, 2, 64, d, generator=torch.Generator().manual_seed(seed + 1))
    expected = quantize(x, bits, -2, group)
    for lam, r in ((0.0, rank), (1.0, 0)):
        updates = block_updates(query_subspace(q, r), lam, g)
        for a, b in zip(squat_quantize(x, updates, bits, group), expected):
            assert torch.equal(a, b)


@given(keys, st.floats(1e-3, 1.0))
def test_codes_on_grid_and_each_block_within_half_a_step(args, lam):
    """P5–P7: codes in range; every block is within Δ/2 of its values *after* the earlier blocks'
    corrections (recomputed here from the outputs), not necessarily of the original keys."""
    (d, g), bits, group, groups, seed = args
    x = _keys(seed, groups, group, d)
    q = torch.randn(2, 2, 64, d, generator=torch.Generator().manual_seed(seed + 1))
    updates = block_updates(query_subspace(q, 5), lam, g)
    codes, scale, zero = squat_quantize(x, updates, bits, group)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2**bits - 1
    x_hat = dequantize(codes, scale, zero, bits, -2, group)
    current = x.double().clone()  # the pre-quantization values, block by block
    step = scale.double().repeat_interleave(group, -2)
    for t in range(d // g):
        block = slice(t * g, (t + 1) * g)
        error = x_hat[..., block].double() - current[..., block]
        tolerance = 1e-5 * (current[..., block].abs() + step[..., block]) + 1e-6
        assert bool((error.abs() <= step[..., block] / 2 + tolerance).all())
        if t < d // g - 1:
            current[..., (t + 1) * g :] += error @ _rows_of(updates, d, g, t + 1).double().transpose(-1, -2)


def test_large_penalty_makes_each_corrected_step_orthogonal_to_the_subspace():
    """P11: for a compensated step, ‖Q̂δ_t‖ / (σ₁‖d_t‖) → 0 as λσ₁² grows (rank(Q̂[:, tg:]) = r)."""
    d, g, rank = 64, 32, 5
    qhat = query_subspace(_queries(0, 256, d), rank)
    sigma2 = float((qhat[0] ** 2).sum())
    error = torch.randn(g, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ratios = []
    for kappa in (1e-1, 1e1, 1e3, 1e5):
        m = block_updates(qhat, kappa / sigma2, g).double()
        delta = torch.cat([error, m @ error])
        ratios.append(float((qhat @ delta).norm() / (math.sqrt(sigma2) * error.norm())))
    assert all(a > b for a, b in zip(ratios, ratios[1:])), ratios
    assert ratios[-1] < 1e-3, ratios


def test_logit_error_on_prompt_queries_is_smaller_than_plain_quantization():
    """P19 (statistical): the median over seeds of ‖Q e_squat‖ / ‖Q e_rtn‖ on the prompt's queries is
    below 0.95 for λσ₁² in [1, 1e3] (spec: ≈0.88 at 1, ≈0.72 at 10–1000 with g = D/2)."""
    d, g, group = 64, 32, 32
    for kappa in (1.0, 1e2, 1e3):
        ratios = []
        for seed in range(20):
            q = _queries(seed, 128, d).float()
            x = _keys(seed, 4, group, d, batch=1, heads=1)
            qhat = query_subspace(q, 5)
            lam = kappa / float((qhat[0] ** 2).sum())
            rtn = dequantize(*quantize(x, 2, -2, group), 2, -2, group) - x
            sq = dequantize(*squat_quantize(x, block_updates(qhat, lam, g), 2, group), 2, -2, group) - x
            ratios.append(float((sq[0, 0] @ q.T).norm() / (rtn[0, 0] @ q.T).norm()))
        assert float(torch.tensor(ratios).median()) < 0.95, (kappa, sorted(ratios))


def _attention(q, k, v):
    """Attn(q, K, V) = softmax(K q / √d)ᵀ V for one query: q [D], K, V [N, D]."""
    return torch.softmax(k @ q / math.sqrt(q.numel()), 0) @ v


@given(st.integers(0, 2**16), st.integers(2, 64), st.sampled_from([8, 32, 64]), st.floats(1e-3, 1.0))
def test_corrected_attention_error_bound(seed, n, d, noise):
    """P16: ‖ΔAttn‖ ≤ Σ‖v_i - v̂_i‖ + ‖V̂‖_F/(2√d)·‖(K - K̂)q‖ (the bound Theorem 1's proof supports)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((d,), (n, d), (n, d)))
    k_hat = k + noise * torch.randn(n, d, generator=g, dtype=torch.float64)
    v_hat = v + noise * torch.randn(n, d, generator=g, dtype=torch.float64)
    lhs = (_attention(q, k, v) - _attention(q, k_hat, v_hat)).norm()
    rhs = (v - v_hat).norm(dim=1).sum() + v_hat.norm() / (2 * math.sqrt(d)) * ((k - k_hat) @ q).norm()
    assert lhs <= rhs * (1 + 1e-12)


def test_printed_theorem_1_is_false():
    """The bound as printed multiplies the key term by the value errors, so exact values make it 0,
    while key errors still move the output (spec §5.1)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    k_hat = k + 0.5 * torch.randn(8, 16, generator=g)
    printed_bound = 0.0  # (Σ‖v - v̂‖)/(2√d)·Σ|q·(k - k̂)| + Σ‖v - v̂‖ with v̂ = v
    assert float((_attention(q, k, v) - _attention(q, k_hat, v)).norm()) > printed_bound + 1e-3


def test_bad_block_size():
    with pytest.raises(ValueError, match="block=24 must divide the head dimension 64"):
        block_updates(torch.zeros(5, 64), 1e-3, 24)
