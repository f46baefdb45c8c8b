"""Small linear-algebra helpers: centred thin SVD (PCA) with masked rows, weight factors, ridge regression."""

from collections.abc import Iterable

import torch


def masked_pca(
    x: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centred thin SVD of the valid rows of each matrix in a batch.

    `x_c = x - mean = U diag(S) Vᵀ` over the rows where `valid` is True; rows that are not valid
    contribute nothing (they are zeroed after centring).

    Args:
        x: [..., T, D] float.
        valid: [..., T] bool, or None for all rows.

    Returns:
        mean: [..., D] float32, the mean of the valid rows.
        basis: [..., D, D] float32, columns are the right singular vectors V, by decreasing S.
        singular: [..., D] float32, S (zero-padded when fewer than D valid rows).
    """
    x = x.float()
    if valid is None:
        valid = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
    w = valid.unsqueeze(-1).float()
    count = w.sum(-2).clamp_min(1.0)
    mean = (x * w).sum(-2) / count
    centred = (x - mean.unsqueeze(-2)) * w
    # The Gram matrix keeps memory at D x D whatever T is; float64 keeps its eigenvalues accurate.
    gram = centred.double().transpose(-1, -2) @ centred.double()
    eigvals, eigvecs = torch.linalg.eigh(gram)
    order = torch.arange(eigvals.shape[-1] - 1, -1, -1, device=x.device)
    singular = eigvals.index_select(-1, order).clamp_min(0).sqrt().float()
    basis = eigvecs.index_select(-1, order).float()
    return mean, basis, singular


def weight_factors(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Thin SVD of a weight `w = U·diag(S)·Bᵀ` split as `w = U·R` (XQuant §1.3), computed in float64.

    Args:
        w: [d, n].

    Returns:
        U: [d, r] orthonormal columns, by decreasing singular value (r = min(d, n)); R = diag(S)·Bᵀ: [r, n].
    """
    u, s, bt = torch.linalg.svd(w.double(), full_matrices=False)
    return u, s[:, None] * bt


def ridge(
    x: torch.Tensor, y: torch.Tensor, alpha: float, bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Closed-form ridge regression `W = (XᵀX + αI)⁻¹ Xᵀ Y` (intercept unpenalised).

    Args:
        x: [N, Din] float. y: [N, Dout] float.
        alpha: L2 penalty α ≥ 0.

    Returns:
        weight: [Din, Dout] float32, so that `ŷ = x @ weight + bias`.
        bias: [Dout] float32, or None.
    """
    n = x.shape[0]
    ones = torch.ones(n, 1, dtype=torch.float64, device=x.device)
    xd = torch.cat([x.double(), ones], 1) if bias else x.double()
    return ridge_from_moments(xd.T @ xd, xd.T @ y.double(), alpha, bias)


def ridge_from_moments(
    xtx: torch.Tensor, xty: torch.Tensor, alpha: float, bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ridge solution from accumulated moments, for streaming calibration.

    Args:
        xtx: [Din(+1), Din(+1)] float64, `Σ x̃ x̃ᵀ` with `x̃ = [x, 1]` when `bias`.
        xty: [Din(+1), Dout] float64, `Σ x̃ yᵀ`.
        alpha: L2 penalty on the weights (not on the intercept).

    Returns:
        weight: [Din, Dout] float32. bias: [Dout] float32, or None.
    """
    penalty = torch.full((xtx.shape[0],), float(alpha), dtype=xtx.dtype, device=xtx.device)
    if bias:
        penalty[-1] = 0.0
    solution = torch.linalg.solve(xtx + torch.diag(penalty), xty)
    if bias:
        return solution[:-1].float(), solution[-1].float()
    return solution.float(), None


def ridge_streamed(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression with intercept over row batches, only the moments held (AQUA-KV §3.2 calibration).

    The penalty is relative, `λ = alpha · mean(diag(Σ z̃z̃ᵀ))` with `z̃ = [z, 1]` (the intercept unpenalised),
    so it does not depend on the scale of the inputs.

    Args:
        batches: `(z [N, Din], y [N, Dout])` pairs, any number of rows each.
        alpha: relative damping ≥ 0 (0: ordinary least squares).

    Returns:
        weight: [Din, Dout] float32, bias: [Dout] float32, so that `ŷ = z @ weight + bias`.
    """
    xtx = xty = None
    for z, y in batches:
        zt = torch.cat([z.double(), torch.ones(z.shape[0], 1, dtype=torch.float64, device=z.device)], 1)
        xtx = zt.T @ zt if xtx is None else xtx + zt.T @ zt
        xty = zt.T @ y.double() if xty is None else xty + zt.T @ y.double()
    if xtx is None:
        raise ValueError("ridge_streamed got no rows")
    return ridge_from_moments(xtx, xty, alpha * float(xtx.diagonal().mean()), bias=True)
