"""Fast orthonormal Walsh–Hadamard transform along the last axis."""

import math

import torch


def hadamard_block(n: int) -> int:
    """Largest power of two dividing `n`: the block size of the block-diagonal transform."""
    if n < 1:
        raise ValueError(f"hadamard needs a positive size, got {n}")
    return n & -n


def hadamard(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard transform `x · H_n / sqrt(n)` in O(n log n).

    For a size that is not a power of two the transform is block-diagonal, one Hadamard block of
    `block` (default: the largest power of two dividing the size) per slice. The matrix is symmetric and
    orthogonal, so the transform is its own inverse.

    Args:
        x: [..., D] float.
        block: power of two dividing D.

    Returns:
        [..., D], x's dtype (computed in float32 for half inputs).
    """
    d = x.shape[-1]
    block = hadamard_block(d) if block is None else block
    if block & (block - 1) or d % block:
        raise ValueError(f"block={block} must be a power of two dividing the last axis size {d}")
    y = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = y.reshape(*x.shape[:-1], d // block, block)
    h = 1
    while h < block:
        pairs = y.unflatten(-1, (block // (2 * h), 2, h))  # [..., blocks, block/2h, 2, h]
        a, b = pairs.unbind(-2)
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * (1.0 / math.sqrt(block))).reshape(x.shape).to(x.dtype)
