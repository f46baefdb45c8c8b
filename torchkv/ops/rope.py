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
