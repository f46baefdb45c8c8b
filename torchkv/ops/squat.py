"""SQuat (Wang et al., 2025): key quantization whose error is pushed out of the prompt's query subspace.

Keys are quantized per channel (groups of G tokens), one block of g channels at a time; after each
block the channels not yet quantized are corrected in closed form so that the key error δ minimises
`‖δ‖² + λ‖Q̂δ‖²` (SQuat Eq. 6, Lemma 2), where Q̂ spans the dominant directions of the prompt's queries.
"""

import torch

from torchkv.ops.quantize import dequantize, quantize


def query_subspace(q: torch.Tensor, rank: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Q̂ = diag(σ_1..r)·V_rᵀ of the stacked query rows (SQuat §3.2): the best rank-r factor of `QᵀQ`.

    Args:
        q: [..., N, D] float, query rows (not centred, not scaled by 1/√D).
        rank: r ≥ 0; rows past the number of non-zero singular values come out as zeros.
        valid: [..., N] bool, False at rows to leave out (padding), or None.

    Returns:
        [..., r, D] float64.
    """
    q = q.double()
    if valid is not None:
        q = q * valid.unsqueeze(-1)
    gram = q.transpose(-1, -2) @ q  # [..., D, D]: memory independent of N
    eigvals, eigvecs = torch.linalg.eigh(gram)  # ascending
    first = q.shape[-1] - min(rank, q.shape[-1])  # the top r eigenpairs are the last ones
    sigma = eigvals[..., first:].flip(-1).clamp_min(0).sqrt()  # [..., r]
    qhat = sigma.unsqueeze(-1) * eigvecs[..., first:].flip(-1).transpose(-1, -2)
    return torch.nn.functional.pad(qhat, (0, 0, 0, rank - qhat.shape[-2]))


def block_updates(qhat: torch.Tensor, lam: float, block: int) -> torch.Tensor:
    """The correction matrices M_t of SQuat Eq. 6, stacked, in the direct closed form.

    With `P = I + λ Q̂ᵀQ̂`, the minimiser of `‖δ‖² + λ‖Q̂δ‖²` over the channels after block t, given the
    error `d_t` of block t, is `M_t d_t` with `M_t = -P[tg:, tg:]⁻¹ P[tg:, (t-1)g:tg]` (equal to
    SQuat's `B_t H_t`, Prop. 2, without the recursion).

    Args:
        qhat: [..., r, D] float (from `query_subspace`).
        lam: λ ≥ 0.
        block: g, channels per block; must divide D.

    Returns:
        [..., Σ_t (D - t·g), g] float32: M_1, ..., M_{T-1} stacked along the rows (T = D/g).
    """
    d = qhat.shape[-1]
    if block < 1 or d % block:
        raise ValueError(f"block={block} must divide the head dimension {d}; choose a divisor of {d}")
    qhat = qhat.double()
    p = lam * qhat.transpose(-1, -2) @ qhat + torch.eye(d, dtype=torch.float64, device=qhat.device)
    mats = [
        -torch.linalg.solve(p[..., end:, end:], p[..., end:, end - block : end])
        for end in range(block, d, block)
    ]
    if not mats:
        return qhat.new_zeros((*qhat.shape[:-2], 0, block), dtype=torch.float32)
    return torch.cat(mats, -2).float()


def squat_quantize(
    x: torch.Tensor,
    updates: torch.Tensor,
    bits: int,
    group: int,
    meta_dtype: torch.dtype = torch.float16,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel group quantization of keys, block by block with SQuat's correction (Alg. 1, QUANT).

    Block t (channels [(t-1)g, tg)) is quantized from its current, already corrected, values; its error
    `d_t = x̂ - x` then moves the channels after it by `M_t d_t`. Earlier blocks stay frozen; the last
    block is not compensated.

    Args:
        x: [B, H, T, D] float, T a multiple of `group`.
        updates: [B or 1, H, Σ_t (D - t·g), g] float (from `block_updates`); g is read from its last axis.
        bits: code width b.
        group: G, tokens sharing a scale and zero point per channel.
        meta_dtype: dtype of the stored scale and zero.
        valid: broadcastable to x, False at padding tokens (kept out of the statistics).

    Returns:
        codes: [B, H, T, D] uint8. scale, zero: [B, H, T/G, D] `meta_dtype` (as `quantize` per channel).
    """
    block, d = updates.shape[-1], x.shape[-1]
    if d % block:
        raise ValueError(f"the update matrices are for blocks of {block} channels, which do not tile head_dim {d}")
    rest = x.float()
    codes, scales, zeros = [], [], []
    row = 0
    for _ in range(d // block):
        current, rest = rest[..., :block], rest[..., block:]
        c, s, z = quantize(current, bits, -2, group, False, meta_dtype, valid)
        codes.append(c)
        scales.append(s)
        zeros.append(z)
        if rest.shape[-1]:
            m = updates[..., row : row + rest.shape[-1], :].float()  # [B, H, D - tg, g]
            row += rest.shape[-1]
            error = dequantize(c, s, z, bits, -2, group) - current  # [B, H, T, g]
            rest = rest + error @ m.transpose(-1, -2)
    return torch.cat(codes, -1), torch.cat(scales, -1), torch.cat(zeros, -1)
