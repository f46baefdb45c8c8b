"""Rotary position embedding (RoPE), rotate-half convention, as in Hugging Face Llama-family models."""

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x·cos + rotate_half(x)·sin` on the first R features (partial rotary when R < D).

    Args:
        x: [B, H, T, D] float.
        cos, sin: [B or 1, T, R] with R ≤ D even (the model's rotary embedding of each token).

    Returns:
        [B, H, T, D], float32. `apply_rope(apply_rope(x, cos, sin), cos, -sin) == x` (a rotation).
    """
    r = cos.shape[-1]
    c, s = cos.float()[:, None], sin.float()[:, None]  # [B, 1, T, R]
    x = x.float()
    xr = x[..., :r]
    rotated = torch.cat([-xr[..., r // 2 :], xr[..., : r // 2]], dim=-1)
    return torch.cat([xr * c + rotated * s, x[..., r:]], dim=-1)


def turned_dot(q: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`q · apply_rope(x)` at every position without forming the turned vectors: one vector `x` per KV head
    turned to each of T positions, scored by g queries. Rotate-half pairs feature j with j + R/2 under one angle,
    so the tables' halves are equal and only the first is read:
    `q·R_t·x = Σ_{j<R/2} cos_tj·(q_j·x_j + q_{j+R/2}·x_{j+R/2}) + sin_tj·(q_{j+R/2}·x_j − q_j·x_{j+R/2})`.

    Args:
        q: [B, H, g, D] float. x: [B, H, 1, D] float. cos, sin: [B, T, R], R ≤ D even, halves equal.

    Returns:
        [B, H, g, T] float32.
    """
    h = cos.shape[-1] // 2
    q, x = q.float(), x.float()
    q1, q2, x1, x2 = q[..., :h], q[..., h : 2 * h], x[..., :h], x[..., h : 2 * h]
    out = torch.einsum("bhgj,btj->bhgt", q1 * x1 + q2 * x2, cos[..., :h].float())
    out = out + torch.einsum("bhgj,btj->bhgt", q2 * x1 - q1 * x2, sin[..., :h].float())
    return out + (q[..., 2 * h :] * x[..., 2 * h :]).sum(-1, keepdim=True)


def turned_dot_by_chunk(q: torch.Tensor, x: torch.Tensor, anchor_cos: torch.Tensor, anchor_sin: torch.Tensor,
                        step_cos: torch.Tensor, step_sin: torch.Tensor) -> torch.Tensor:
    """`turned_dot` of tokens in chunks whose positions run on from each chunk's first, `a + j`, reading the tables
    at the NC anchors `a` and at the C steps `j` instead of at every token. With `α_i = q_i·x_i + q_{i+R/2}·x_{i+R/2}`
    and `β_i = q_{i+R/2}·x_i − q_i·x_{i+R/2}` (`turned_dot`), angle addition gives
    `q·R_{a+j}·x = Σ_i cos θ_i j·(α_i cos θ_i a + β_i sin θ_i a) + sin θ_i j·(β_i cos θ_i a − α_i sin θ_i a)`.

    Args:
        q: [B, H, g, D] float. x: [B, H, 1, D] float.
        anchor_cos, anchor_sin: [B, NC, R], the tables at each chunk's first position (the model's scaling included).
        step_cos, step_sin: [1, C, R], the tables at 0..C−1 over the table at 0 (unscaled), halves equal.

    Returns:
        [B, H, g, NC·C] float32, `turned_dot` over the NC·C tokens in order.
    """
    h = anchor_cos.shape[-1] // 2
    q, x = q.float(), x.float()
    q1, q2, x1, x2 = q[..., :h], q[..., h : 2 * h], x[..., :h], x[..., h : 2 * h]
    alpha, beta = (q1 * x1 + q2 * x2)[..., None, :], (q2 * x1 - q1 * x2)[..., None, :]  # [B, H, g, 1, R/2]
    ca, sa = anchor_cos[:, None, None, :, :h].float(), anchor_sin[:, None, None, :, :h].float()  # [B, 1, 1, NC, R/2]
    by_cos, by_sin = alpha * ca + beta * sa, beta * ca - alpha * sa  # [B, H, g, NC, R/2]
    out = torch.einsum("bhgci,ti->bhgct", by_cos, step_cos[0, :, :h].float())
    out = out + torch.einsum("bhgci,ti->bhgct", by_sin, step_sin[0, :, :h].float())
    return out.flatten(-2) + (q[..., 2 * h :] * x[..., 2 * h :]).sum(-1, keepdim=True)
