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
    turned to each of T positions, scored by g queries (`R_t·x = x·cos_t + rotate_half(x)·sin_t`).

    Args:
        q: [B, H, g, D] float. x: [B, H, 1, D] float. cos, sin: [B, T, R], R ≤ D even.

    Returns:
        [B, H, g, T] float32.
    """
    r = cos.shape[-1]
    q, x = q.float(), x.float()
    half = torch.cat([-x[..., r // 2 : r], x[..., : r // 2]], dim=-1)  # rotate_half of x's rotary part
    out = torch.einsum("bhgr,btr->bhgt", q[..., :r] * x[..., :r], cos.float())
    out = out + torch.einsum("bhgr,btr->bhgt", q[..., :r] * half, sin.float())
    return out + (q[..., r:] * x[..., r:]).sum(-1, keepdim=True)
