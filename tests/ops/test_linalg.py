import torch
from hypothesis import given
from hypothesis import strategies as st

from torchkv.ops import masked_pca, ridge, ridge_from_moments


@given(st.integers(8, 60), st.integers(2, 12), st.integers(0, 1000))
def test_pca_matches_svd_of_centred_rows(t, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g, dtype=torch.float64) * torch.linspace(3, 0.1, d, dtype=torch.float64)
    mean, basis, singular = masked_pca(x)
    centred = x - x.mean(0)
    expected = torch.linalg.svdvals(centred)
    torch.testing.assert_close(singular[: expected.numel()].double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(basis.T.double() @ basis.double(), torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-5)
    # energy of each latent column is its squared singular value, non-increasing
    latent = centred @ basis.double()
    torch.testing.assert_close(latent.pow(2).sum(0), singular.double().pow(2), rtol=1e-4, atol=1e-4)
    assert torch.all(singular[:-1] >= singular[1:] - 1e-5)


def test_pca_ignores_masked_rows():
    x = torch.randn(40, 6)
    garbage = torch.cat([torch.full((10, 6), 1e3), x])
    valid = torch.cat([torch.zeros(10, dtype=torch.bool), torch.ones(40, dtype=torch.bool)])
    m1, b1, s1 = masked_pca(x)
    m2, b2, s2 = masked_pca(garbage, valid)
    torch.testing.assert_close(m1, m2)
    torch.testing.assert_close(s1, s2, rtol=1e-4, atol=1e-4)
    # compare projectors, which are sign-invariant
    torch.testing.assert_close(b1[:, :3] @ b1[:, :3].T, b2[:, :3] @ b2[:, :3].T, rtol=1e-3, atol=1e-3)


def test_ridge_closed_form_and_least_squares_limit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g, dtype=torch.float64)
    w_true = torch.randn(5, 3, generator=g, dtype=torch.float64)
    y = x @ w_true + 0.5
    w, b = ridge(x, y, alpha=0.0)
    torch.testing.assert_close(w.double(), w_true, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b.double(), torch.full((3,), 0.5, dtype=torch.float64), rtol=1e-4, atol=1e-4)
    alpha = 7.0
    xc = x - x.mean(0)
    expected = torch.linalg.solve(xc.T @ xc + alpha * torch.eye(5, dtype=torch.float64), xc.T @ (y - y.mean(0)))
    w, _ = ridge(x, y, alpha=alpha)
    torch.testing.assert_close(w.double(), expected, rtol=1e-5, atol=1e-5)


def test_moments_form_equals_direct():
    x, y = torch.randn(50, 4), torch.randn(50, 2)
    xd = torch.cat([x.double(), torch.ones(50, 1, dtype=torch.float64)], 1)
    direct = ridge(x, y, 0.3)
    streamed = ridge_from_moments(xd[:20].T @ xd[:20] + xd[20:].T @ xd[20:], xd.T @ y.double(), 0.3)
    torch.testing.assert_close(direct[0], streamed[0])
    torch.testing.assert_close(direct[1], streamed[1])
