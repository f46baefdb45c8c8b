"""Uniform affine quantization along one axis, in groups.

The two KV layouts are groups along one axis of `x: [..., T, D]`:

| layout     | `dim` | a group is                      | scale/zero shape   |
|------------|-------|---------------------------------|--------------------|
| per-token  | -1    | `group` channels of one token   | `[..., T, D/G]`    |
| per-channel| -2    | `group` tokens of one channel   | `[..., T/G, D]`    |
"""

import torch

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
#: how a group's step Δ is chosen: "range" covers its values (min-max, or absmax when symmetric); "gaussian"
#: is the MSE-optimal uniform step for normal values, `Δ = κ_b·rms` (symmetric; values beyond clip)
STEPS = ("range", "gaussian")
#: κ_b = Δ/σ of the MSE-optimal symmetric uniform quantizer with 2^b levels for N(0, σ²) (Max 1960, Table II),
#: for groups made near-Gaussian by a rotation (Hadamard): the scalar analogue of HIGGS' norm-scaled grids
GAUSSIAN_STEP = {1: 1.59577, 2: 0.99568, 3: 0.58602, 4: 0.33520, 5: 0.18814, 6: 0.10406, 7: 0.05687, 8: 0.03076}


def _check_quantize_args(x: torch.Tensor, bits: int, dim: int, group: int) -> int:
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got dtype {x.dtype}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; allowed: {SUPPORTED_BITS}")
    dim = dim % x.dim()
    if group < 1 or x.shape[dim] % group:
        raise ValueError(
            f"group={group} must divide the size {x.shape[dim]} of axis {dim}; "
            f"choose a divisor of {x.shape[dim]}"
        )
    return dim


def _grouped(x: torch.Tensor, dim: int, group: int) -> torch.Tensor:
    """[..., n, ...] -> [..., n/G, G, ...] along `dim`."""
    return x.unflatten(dim, (x.shape[dim] // group, group))


def _round_toward(x32: torch.Tensor, dtype: torch.dtype, down: bool) -> torch.Tensor:
    """Cast to `dtype` so that the stored value is <= x32 (`down`) or >= x32.

    Values exact in `dtype` are kept; others move by one unit of `dtype`'s precision before rounding
    to nearest, which brackets them (plain arithmetic: `nextafter` miscompiles for half types).
    """
    if dtype == torch.float32:
        return x32
    info = torch.finfo(dtype)
    shift = x32.abs() * info.eps + 2 * info.smallest_normal * info.eps
    nearest = x32.to(dtype)
    bracketed = (x32 - shift if down else x32 + shift).to(dtype)
    return torch.where(nearest.float() == x32, nearest, bracketed)


def _masked_reduce(
    xg: torch.Tensor, vg: torch.Tensor | None, dim: int, reduce, fill: float
) -> torch.Tensor:
    """`reduce` over `dim` of the valid elements; a group with none reduces to 0."""
    if vg is None:
        return reduce(xg, dim, keepdim=True)
    out = reduce(torch.where(vg, xg, fill), dim, keepdim=True)
    return torch.where(vg.any(dim, keepdim=True), out, torch.zeros_like(out))


def _symmetric_step(xg: torch.Tensor, vg: torch.Tensor | None, dim: int, bits: int, meta_dtype: torch.dtype,
                    step: str) -> torch.Tensor:
    """The stored step Δ of symmetric groups along `dim` of `xg` (valid elements `vg` only), keepdim, `meta_dtype`:
    `κ_b·sqrt(mean x²)` for the "gaussian" step, else `2·max|x| / (2^b - 1)` rounded up."""
    if step == "gaussian":
        square = xg.square() if vg is None else torch.where(vg, xg.square(), 0.0)
        count = xg.shape[dim] if vg is None else vg.sum(dim, keepdim=True).clamp_min(1)
        rms = (square.sum(dim, keepdim=True) / count).sqrt()
        # clamped: float8 e4m3 has no infinity, an overflow would store NaN
        return (rms * GAUSSIAN_STEP[bits]).clamp(max=torch.finfo(meta_dtype).max).to(meta_dtype)
    absmax = _masked_reduce(xg.abs(), vg, dim, torch.amax, 0.0)
    return _round_toward(absmax * (2.0 / (2**bits - 1)), meta_dtype, down=False)


def quantize(
    x: torch.Tensor,
    bits: int,
    dim: int,
    group: int,
    symmetric: bool = False,
    meta_dtype: torch.dtype = torch.float16,
    valid: torch.Tensor | None = None,
    step: str = "range",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest uniform quantization of groups of `group` elements along `dim`.

    Args:
        x: [..., n, ...] float; `n = x.shape[dim]` must be a multiple of `group`.
        bits: code width b, 1..8.
        dim: the grouped axis (-1: per-token, -2: per-channel for `[..., T, D]`).
        group: elements per group G.
        symmetric: midrise levels `(c - (2^b-1)/2)·Δ` around 0, no zero point.
        meta_dtype: dtype of the stored scale and zero point.
        valid: bool, broadcastable to x; elements where False (padding) stay out of the group
            statistics and are clamped into the group's range. A group with no valid element is all 0.
        step: "range" or "gaussian" (symmetric only): `Δ = κ_b·sqrt(mean x²)` over the group (`GAUSSIAN_STEP`),
            codes clamped to the 2^b levels, so every value takes its nearest level.

    Returns:
        codes: same shape as x, uint8 in [0, 2^b - 1].
        scale: x's shape with n replaced by n/G, `meta_dtype` (the step Δ).
        zero: like scale (the group minimum m), or None when symmetric.

    Asymmetric (SQuat §2): `Δ = (M - m)/(2^b - 1)`, `c = round((x - m)/Δ)`, `x̂ = c·Δ + m`.
    The stored m is rounded down and Δ up, so `|x̂ - x| ≤ Δ/2` holds with the stored values.
    A zero-range group has code 0 and a step of a few ulps. Under `torch.compile`, pass
    `options={"emulate_precision_casts": True}` so codes use the stored (rounded) scale and zero, as in eager.
    """
    dim = _check_quantize_args(x, bits, dim, group)
    qmax = 2**bits - 1
    xg = _grouped(x.float(), dim, group)  # [..., n/G, G, ...]
    vg = None if valid is None else _grouped(valid.expand(x.shape), dim, group)
    if step not in STEPS or (step == "gaussian" and not symmetric):
        raise ValueError(f"step={step!r} is not supported; allowed: {STEPS} ('gaussian' with symmetric=True)")
    if symmetric:
        scale = _symmetric_step(xg, vg, dim + 1, bits, meta_dtype, step)
        step_ = scale.float()
        scaled = torch.where(step_ > 0, xg / step_, torch.zeros_like(xg)) + qmax / 2
        zero = None
    else:
        lo = _masked_reduce(xg, vg, dim + 1, torch.amin, float("inf"))
        hi = _masked_reduce(xg, vg, dim + 1, torch.amax, float("-inf"))
        zero = _round_toward(lo, meta_dtype, down=True)
        scale = _round_toward((hi - zero.float()) / qmax, meta_dtype, down=False)
        step_ = scale.float()
        scaled = torch.where(step_ > 0, (xg - zero.float()) / step_, torch.zeros_like(xg))
        zero = zero.squeeze(dim + 1)
    codes = torch.round(scaled).clamp_(0, qmax)
    codes = codes.to(torch.uint8).flatten(dim, dim + 1)
    return codes, scale.squeeze(dim + 1), zero


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    dim: int,
    group: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize`: `x̂ = c·Δ + m` (asymmetric) or `(c - (2^b-1)/2)·Δ` (symmetric).

    Args:
        codes: [..., n, ...] uint8.
        scale: codes' shape with n replaced by n/G.
        zero: like scale, or None for symmetric codes.

    Returns:
        x̂: codes' shape, `dtype`.
    """
    dim = dim % codes.dim()
    c = _grouped(codes, dim, group).float()
    step = scale.float().unsqueeze(dim + 1)
    if zero is None:
        x = (c - (2**bits - 1) / 2) * step
    else:
        x = c * step + zero.float().unsqueeze(dim + 1)
    return x.flatten(dim, dim + 1).to(dtype)
