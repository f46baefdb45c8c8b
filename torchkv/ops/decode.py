"""Decode attention that reads packed codes directly (one query per row; no reconstructed K or V).

Affine codes `x̂ = c·Δ + m` are scored without forming x̂: the scale and zero point are folded into
the (tiny) query or probability tensors and the codes are unpacked inside the reduction, so
torch.compile fuses unpacking, multiply and sum into one pass over the packed bytes.

Codes stay in their planar form `[..., P, M]` (channel `d = i·M + j` is byte j of plane i, see
`ops.pack`), and every per-channel vector is viewed the same way, so each plane is one vectorized
shift-and-mask of contiguous bytes. Encoded tensors arrive viewed by chunk, `[B, H, NC, C, ...]`
(NC chunks of C tokens): compile with the chunk axis marked dynamic, and one graph serves every length.
"""

import torch
import torch.nn.functional as F

from torchkv.ops.pack import unpack_planes


def code_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Planar-packed `[..., M]` uint8 -> codes `[..., P, M]` float32 (P = 8/bits; 8-bit codes are unpacked).
    Shifted as int32: Inductor's CPU code shifts uint8 lanes in part-filled vectors (AMD EPYC, AVX2, 2-bit codes
    of 3 KV heads at 8K tokens: 1.9 ms against 1.4)."""
    return (packed[..., None, :] if bits == 8 else unpack_planes(packed.int(), bits)).float()


def _planar(x: torch.Tensor, planes: int, width: int) -> torch.Tensor:
    """A per-channel `[..., D]` tensor as `[..., P, M]`, zero-padded to P·M channels."""
    x = torch.nn.functional.pad(x.float(), (0, planes * width - x.shape[-1]))
    return x.unflatten(-1, (planes, width))


def _channel_groups(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """Sum a planar `[..., P, M]` tensor over channel groups of `group` among the first `dim`: -> `[..., dim/group]`."""
    planes, width = x.shape[-2:]
    if planes * width == dim and group % width == 0:  # whole planes per group
        return x.sum(-1).unflatten(-1, (-1, group // width)).sum(-1)
    if planes * width == dim and width % group == 0:  # whole groups per plane
        return x.unflatten(-1, (width // group, group)).sum(-1).flatten(-2)
    return x.flatten(-2)[..., :dim].unflatten(-1, (-1, group)).sum(-1)


def _zero_point(scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The additive term m of `x̂ = c·Δ + m` (symmetric codes: `m = -Δ·(2^b - 1)/2`)."""
    return scale.float() * (-(2**bits - 1) / 2) if zero is None else zero.float()


def affine_scores(
    q: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    axis: str,
) -> torch.Tensor:
    """`q · x̂ᵀ` for affine-quantized keys, without reconstructing them.

    Args:
        q: [B, H, g, D] float32, the g query heads reading each KV head (softmax scale folded in).
        codes: [B, H, NC, C, P, M] float32 codes (from `code_planes`).
        scale, zero: axis="channel" (groups of Gt tokens): [B, H, NC, C/Gt, D];
            axis="token" (groups of G channels): [B, H, NC, C, D/G]. zero None: symmetric codes.

    Returns:
        [B, H, g, NC, C] float32.

    Per channel: `Σ_d c_td·(q_d Δ_gd) + Σ_d q_d m_gd`; per token: `Σ_k Δ_tk Σ_{d∈k} q_d c_td + Σ_k m_tk Σ_{d∈k} q_d`.
    """
    b, h, nc, c, planes, width = codes.shape
    zero = _zero_point(scale, zero, bits)
    qp = _planar(q, planes, width)  # [B, H, g, P, M]
    if axis == "channel":
        groups = scale.shape[3]
        qs = qp[:, :, :, None, None] * _planar(scale, planes, width)[:, :, None]  # [B, H, g, NC, C/Gt, P, M]
        qm = (q[:, :, :, None, None, :] * zero[:, :, None]).sum(-1)  # [B, H, g, NC, C/Gt]
        grouped = codes.view(b, h, 1, nc, groups, c // groups, planes, width)
        return ((grouped * qs[:, :, :, :, :, None]).sum((-1, -2)) + qm[..., None]).flatten(-2)
    dim = q.shape[-1]
    group = dim // scale.shape[-1]
    partial = _channel_groups(codes[:, :, None] * qp[:, :, :, None, None], group, dim)  # [B, H, g, NC, C, D/G]
    q_sum = _channel_groups(qp, group, dim)[:, :, :, None, None]  # [B, H, g, 1, 1, D/G]
    return (partial * scale.float()[:, :, None]).sum(-1) + (zero[:, :, None] * q_sum).sum(-1)


def affine_weighted_sum(
    p: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    axis: str,
    dim: int,
) -> torch.Tensor:
    """`p · x̂` for affine-quantized values, without reconstructing them.

    Args:
        p: [B, H, g, NC, C] float32 attention probabilities.
        codes, scale, zero, axis: as in `affine_scores`.
        dim: D, the number of channels.

    Returns:
        [B, H, g, D] float32.
    """
    if axis == "token":  # a GEMM on CPU and for a shared latent; on a GPU a fused reduction over the packed codes
        gemm = p.device.type == "cpu" or codes.shape[1] == 1 < p.shape[1]
        return (token_weighted_gemm if gemm else token_weighted_reduction)(p, codes, scale, zero, bits, dim)
    b, h, nc, c, planes, width = codes.shape
    g = p.shape[2]
    zero = _zero_point(scale, zero, bits)
    groups = scale.shape[3]
    pg = p.view(b, h, g, nc, groups, c // groups)
    grouped = codes.view(b, h, 1, nc, groups, c // groups, planes, width)
    partial = (grouped * pg[..., None, None]).sum(-3)  # [B, H, g, NC, C/Gt, P, M]
    out = (partial * _planar(scale, planes, width)[:, :, None]).sum((3, 4)).flatten(-2)[..., :dim]
    return out + (zero[:, :, None] * pg.sum(-1)[..., None]).sum((3, 4))


def token_weighted_gemm(
    p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, dim: int
) -> torch.Tensor:
    """`p · x̂` for codes with one step per token and group of channels: `Σ_t (p_t Δ_tk) c_t[k] + Σ_t p_t m_tk`,
    a matrix product per KV head and channel group over the unpacked codes, whose rows are the g query heads
    that read the head (every KV head's, where the codes are one row that all of them read: XQuant's value
    latent). On CPU (and for a shared latent on any device) this runs as a GEMM, which reads each code once for all
    g rows; Inductor's fused reduction over the codes times the weights unpacks them once per query head (AMD EPYC,
    AVX2, 3 KV heads at 8K tokens, 2-bit codes: 4.2 ms against 6.1).

    Args:
        p: [B, H, g, NC, C] float32. codes: [B, H or 1, NC, C, P, M] float32 (from `code_planes`).
        scale, zero: [B, H or 1, NC, C, K] (K groups of `dim / K` channels); zero None: symmetric codes.

    Returns:
        [B, H, g, dim] float32.
    """
    b, h, g = p.shape[:3]
    heads, groups = codes.shape[1], scale.shape[-1]
    rows = p.flatten(-2).reshape(b, heads, h // heads * g, -1)  # [B, Hc, R, T]: the rows reading each code head
    c = codes.flatten(-2)[..., :dim].flatten(2, 3).unflatten(-1, (groups, -1))  # [B, Hc, T, K, G]
    weighted = rows[..., None] * scale.float().flatten(2, 3)[:, :, None]  # [B, Hc, R, T, K]
    out = torch.einsum("bhrtk,bhtkj->bhrkj", weighted, c)
    offset = torch.einsum("bhrt,bhtk->bhrk", rows, _zero_point(scale, zero, bits).flatten(2, 3))
    return (out + offset[..., None]).flatten(-2).reshape(b, h, g, dim)


def token_weighted_reduction(
    p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, dim: int
) -> torch.Tensor:
    """`token_weighted_gemm` for codes per KV head as one elementwise reduction, which Inductor fuses on a GPU so
    that it reads the packed codes and writes no unpacked ones (same arguments)."""
    planes, width = codes.shape[-2:]
    group = dim // scale.shape[-1]
    ps = p[..., None] * scale.float()[:, :, None]  # [B, H, g, NC, C, D/G]
    pm = (p[..., None] * _zero_point(scale, zero, bits)[:, :, None]).sum((3, 4))  # [B, H, g, D/G]
    per_channel = _planar(ps.repeat_interleave(group, -1), planes, width)  # [B, H, g, NC, C, P, M]
    out = (codes[:, :, None] * per_channel).sum((3, 4))  # [B, H, g, P, M]
    return out.flatten(-2)[..., :dim] + pm.repeat_interleave(group, -1)


def grid_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """`q · x̂ᵀ` for vector-quantized rows `x̂_t = m_t · [grid[c_t1], ..., grid[c_tK]]`, without forming x̂.

    A per-step table of every sub-vector's dot product with every grid point, `L[g, k, j] = q_k · grid_j`
    `[B, H, g, K, n]`, turns each score into K look-ups: `q·x̂_t = m_t Σ_k L[g, k, c_tk]`, one `embedding_bag`
    (sum of K table rows per token, each row holding the g query heads' terms). Measured on CPU at 4K tokens:
    half the time of looking up the grid points inside a compiled dot product.

    Args:
        q: [B, H, g, K·d] float32, in the quantizer's normalized domain (rotated by its Hadamard blocks).
        codes: [B, H, NC, C, K] integer grid indices.
        scale: [B, H or 1, NC, C, 1] float, each row's multiplier m_t.
        grid: [n, d] float32.

    Returns:
        [B, H, g, NC, C] float32.
    """
    b, h, nc, c, k = codes.shape
    n, g = grid.shape[0], q.shape[2]
    table = q.unflatten(-1, (k, -1)) @ grid.T  # [B, H, g, K, n]
    table = table.permute(0, 1, 3, 4, 2).reshape(b * h * k * n, g)  # row (b, h, k, j): the g heads' q_k · grid_j
    first = torch.arange(b * h * k, device=codes.device, dtype=torch.int32).view(b * h, 1, k) * n
    rows = codes.reshape(b * h, nc * c, k).int() + first  # [B·H, T, K] rows of the table
    scores = F.embedding_bag(rows.flatten(0, 1), table, mode="sum")  # [B·H·T, g]
    return scores.view(b, h, nc, c, g).permute(0, 1, 4, 2, 3) * scale.float()[:, :, None, ..., 0]


def grid_weighted_sum(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """`Σ_t p_t x̂_t` for vector-quantized rows (as in `grid_scores`), in the normalized domain.

    Args:
        p: [B, H, g, NC, C] float32 attention probabilities.
        codes, scale, grid: as in `grid_scores`.

    Returns:
        [B, H, g, K·d] float32.
    """
    weights = p * scale.float()[:, :, None, ..., 0]  # [B, H, g, NC, C]
    points = grid[codes.long()]  # [B, H, NC, C, K, d]
    return (weights[..., None, None] * points[:, :, None]).sum((3, 4)).flatten(-2)
