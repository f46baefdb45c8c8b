"""HIGGS vector quantization: Hadamard rotation, per-row L2 scale, nearest point of a Gaussian-MSE grid.

A row `x ∈ R^F` becomes `y = √F · H(x) / ‖x‖` (H: orthonormal block Walsh–Hadamard transform), whose
coordinates are close to N(0, 1); `y` is cut into F/d consecutive d-vectors and each is replaced by the
index of its nearest grid point. The grids are fixed points of Lloyd's algorithm for N(0, I_d), so the
method needs no data (HIGGS, arXiv 2411.17525; AQUA-KV §2 and App. H; spec aquakv.md §4.2).

The shipped grids (`GRIDS`, in `torchkv/data/higgs_grids.safetensors`) come from `lloyd_grid` with the
settings `GRID_SAMPLES`, `GRID_ITERS`, `GRID_SEED`. Regenerate the file (same seed, byte-identical
tensors on the same machine and torch build) with:

    OMP_NUM_THREADS=1 python -m torchkv.ops.higgs [output path]
"""

import functools
import math
import sys
import time
from pathlib import Path

import torch

from torchkv._compat import materialized
from torchkv.ops import triton_higgs_encode
from torchkv.ops.hadamard import hadamard, hadamard_block

#: (dim, points) of the shipped grids: d=2 with 16/32/64/128/256 points (2/2.5/3/3.5/4 bits per value: the half
#: steps give a bit allocation finer widths where a layer has one KV head), d=4 with 256 (2 bits), d=8 with 256
#: (1 bit: the HIGGS paper's sub-2-bit grid, AQUA-KV Table 5)
GRIDS = ((2, 16), (2, 32), (2, 64), (2, 128), (2, 256), (4, 256), (8, 256))
GRID_SAMPLES = 1 << 19
GRID_ITERS = 200
GRID_SEED = 0
GRID_FILE = Path(__file__).resolve().parent.parent / "data" / "higgs_grids.safetensors"
#: over-relaxation of the first half of the Lloyd iterations: speeds up its slow (near-neutral) modes
_RELAX = 1.5
#: rows of eager `nearest` scored at a time: [2048, 256] float32 scores fit a core's L2 cache
_EAGER_ROWS = 2048
#: seeded N(0, I_d) draws that `gaussian_mse` measures a grid on (its estimate's relative standard error: about 0.5%)
MSE_SAMPLES = 1 << 16


def grid_key(points: int, dim: int) -> str:
    """Name of a grid in the data file, e.g. "d2_n16"."""
    return f"d{dim}_n{points}"


def nearest(u: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid point: `argmax_j (2 u·c_j − ‖c_j‖²)` = `argmin_j ‖u − c_j‖²`.

    Args:
        u: [..., d] float.
        grid: [n, d] float.

    Returns:
        [...] long (ties resolve to the lowest index). Eager code holds [_EAGER_ROWS, n] float32 scores at a time.
    """
    g = grid.to(device=u.device, dtype=torch.float32)
    d = g.shape[-1]
    flat = u.reshape(-1, d).float()  # [M, d]
    bias, weight = -g.square().sum(-1), 2 * g  # [n], [n, d]
    if torch.compiler.is_compiling():
        # One fused loop over the grid per row. Its d coordinates are copied out as d contiguous rows first, opaquely:
        # fused into the loop, Inductor gathered them with stride d (and recomputed their producers) for every
        # grid point, 9x slower on CPU (27 ms against 3 ms to encode 864 tokens x 3 heads of 64 on the 4-D grid).
        coords = materialized(flat.T.contiguous())  # [d, M]
        scores = bias + sum(coords[i, :, None] * weight[:, i] for i in range(d))  # [M, n]
        return scores.argmax(-1).reshape(u.shape[:-1])
    # eager: blocks of scores that stay in cache, and max's indices (3.4x faster than one argmax over [M, n] on CPU)
    parts = flat.split(_EAGER_ROWS) if flat.device.type == "cpu" else (flat,)
    codes = [torch.addmm(bias, part, weight.T).max(-1).indices for part in parts]
    return torch.cat(codes).reshape(u.shape[:-1])


def nearest_weighted(u: torch.Tensor, grid: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid point under each block's metric: `argmin_j (u − c_j)ᵀ M (u − c_j)` =
    `argmax_j (2 (M u)·c_j − c_jᵀ M c_j)`. With M the second moment of the queries that will read `u`, this is the
    code whose score error `E_q[(q·(u − c))²]` is least (SQuat's aim, error away from the queries, on vector codes).

    Args:
        u: [..., T, K, d] float (T rows of K blocks).
        grid: [n, d] float.
        metric: [..., 1, K, d, d] float, symmetric positive semi-definite, broadcast over the rows.

    Returns:
        [..., T, K] long. Eager code scores `_EAGER_ROWS` blocks' worth of rows at a time.
    """
    g = grid.to(device=u.device, dtype=torch.float32)
    m = metric.float()
    bias = -torch.einsum("nd,...de,ne->...n", g, m, g)  # [..., 1, K, n]
    parts = [u] if torch.compiler.is_compiling() else u.split(max(1, _EAGER_ROWS // u.shape[-2]), dim=-3)
    codes = [(2 * (m @ part.float()[..., None])[..., 0] @ g.T + bias).argmax(-1) for part in parts]
    return torch.cat(codes, dim=-2)


def _sorted(grid: torch.Tensor) -> torch.Tensor:
    """Rows in lexicographic order of their coordinates (first coordinate most significant)."""
    order = torch.arange(grid.shape[0])
    for k in reversed(range(grid.shape[1])):
        order = order[grid[order, k].argsort(stable=True)]
    return grid[order]


def lloyd_grid(points: int, dim: int, *, samples: int, iters: int, seed: int) -> torch.Tensor:
    """An MSE-optimal grid for N(0, I_dim) by Lloyd iterations on fresh seeded Gaussian batches.

    Starts from `points` draws of N(0, (dim+2)/dim · I), the high-resolution optimal point density
    p^{d/(d+2)}. Each iteration draws `samples` points, assigns them to their nearest grid point and
    moves every point toward its cell's centroid `m`: `c ← c + γ(m − c)`, with γ = 1.5 (over-relaxed
    Lloyd) in the first half and γ = 1/k at the k-th step of the second half (a running average of the
    centroid estimates, which damps the sampling noise). A point whose cell is empty stays put.
    Deterministic for a given seed (CPU, float64 accumulation).

    Returns:
        [points, dim] float32, rows in lexicographic order.
    """
    if points < 1 or dim < 1 or samples < 1 or iters < 1:
        raise ValueError(f"lloyd_grid needs positive sizes, got {points=}, {dim=}, {samples=}, {iters=}")
    gen = torch.Generator().manual_seed(seed)
    grid = torch.randn(points, dim, generator=gen, dtype=torch.float64) * math.sqrt((dim + 2) / dim)
    half = iters // 2
    for t in range(iters):
        x = torch.randn(samples, dim, generator=gen)  # [S, d]
        g32 = grid.float()
        codes = nearest(x, g32)  # [S]
        count = torch.bincount(codes, minlength=points).double()[:, None]  # [n, 1]
        total = torch.zeros(points, dim, dtype=torch.float64).index_add_(0, codes, x.double())
        centroid = torch.where(count > 0, total / count.clamp_min(1), grid)
        step = _RELAX if t < half else 1.0 / (t - half + 1)
        grid = grid + step * (centroid - grid)
    return _sorted(grid.float())


@functools.cache
def _shipped() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(GRID_FILE)


def load_grid(points: int, dim: int) -> torch.Tensor:
    """The shipped grid with `points` points in `dim` dimensions: [points, dim] float32 (CPU, shared:
    do not modify it in place)."""
    grids = _shipped()
    key = grid_key(points, dim)
    if key not in grids:
        shipped = ", ".join(f"(dim={d}, points={n})" for d, n in GRIDS)
        raise ValueError(
            f"no HIGGS grid with dim={dim}, points={points}; shipped: {shipped} "
            "(add one to GRIDS and run `python -m torchkv.ops.higgs`)"
        )
    return grids[key]


@functools.cache
def gaussian_mse(points: int, dim: int) -> float:
    """The shipped grid's mean squared error per coordinate on N(0, I_dim) vectors, measured on `MSE_SAMPLES`
    seeded draws: the relative MSE of a HIGGS row, whose coordinates are close to N(0, 1) (e.g. 0.097 for the 4-D
    256-point grid)."""
    grid = load_grid(points, dim)
    x = torch.randn(MSE_SAMPLES, dim, generator=torch.Generator().manual_seed(GRID_SEED))
    return (x - grid[nearest(x, grid)]).square().mean().item()


def _codes_dtype(points: int) -> torch.dtype:
    if points <= 256:
        return torch.uint8
    return torch.int16 if points <= 1 << 15 else torch.int32


def higgs_quantize(
    x: torch.Tensor, grid: torch.Tensor, block: int | None = None, *, scale_dtype: torch.dtype = torch.float32,
    metric: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HIGGS codes of each row: nearest grid points of `y = √F · H(x)/s`, `s = ‖x‖` (spec §4.2).

    The scale is rounded to `scale_dtype` (clamped to its largest finite value) before `y` is formed, so
    `higgs_dequantize` of the stored scale inverts exactly this encoding. A zero row gets scale 0 and
    decodes to exactly 0.

    With a `metric` (the second moment of the rotated queries, one d×d block per code), each code is the nearest
    point under its block's metric (`nearest_weighted`) and the row's scale is refitted under the same metric:
    `s' = s · Σ_b y_bᵀM_b ĉ_b / Σ_b ĉ_bᵀM_b ĉ_b`, the scale of ĉ with the least score error. This path has no fused
    CUDA kernel.

    Args:
        x: [..., T, F] float, F a multiple of the grid dimension d.
        grid: [n, d] float.
        block: Hadamard block size, a power of two dividing F (default: the largest one).
        scale_dtype: dtype of the returned scale.
        metric: None, or [..., 1, F/d, d, d] float, broadcast over the T rows.

    Returns:
        codes: [..., F/d] uint8 (int16 when n > 256).
        scale: [..., 1] scale_dtype, ‖x‖ per row (refitted with a `metric`).
    """
    f, (n, d) = x.shape[-1], grid.shape
    if f % d:
        raise ValueError(f"higgs_quantize: the grid dimension {d} must divide the row size {f}")
    x = x.float()
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # [..., 1]
    scale = norm.clamp(max=torch.finfo(scale_dtype).max).to(scale_dtype)
    s = scale.float()
    inv = torch.where(s > 0, math.sqrt(f) / torch.where(s > 0, s, 1.0), 0.0)
    block = block or hadamard_block(f)
    if metric is None and triton_higgs_encode.runs_on(x, grid, block):  # rotation and nearest point fused
        flat = triton_higgs_encode.higgs_encode(x.reshape(-1, f), inv.reshape(-1), grid, block)
        return flat.reshape(*x.shape[:-1], f // d), scale
    y = hadamard(x, block) * inv  # [..., F], coordinates ≈ N(0, 1)
    blocks = y.unflatten(-1, (f // d, d))  # [..., F/d, d]
    if metric is None:
        return nearest(blocks, grid).to(_codes_dtype(n)), scale
    codes = nearest_weighted(blocks, grid, metric)  # [..., F/d]
    c = grid.to(device=y.device, dtype=torch.float32)[codes]  # [..., F/d, d]
    mc = (metric.float() @ c[..., None])[..., 0]
    num, den = (blocks * mc).sum((-2, -1))[..., None], (c * mc).sum((-2, -1))[..., None]  # [..., 1]
    fitted = torch.where((den > 0) & (num > 0), s * num / torch.where(den > 0, den, 1.0), s)
    return codes.to(_codes_dtype(n)), fitted.clamp(max=torch.finfo(scale_dtype).max).to(scale_dtype)


def higgs_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, grid: torch.Tensor, block: int | None = None
) -> torch.Tensor:
    """Inverse of `higgs_quantize`: `x̂ = H(ĉ) · s/√F` with ĉ the concatenated grid points.

    Args:
        codes: [..., F/d] integer.
        scale: [..., 1] float.
        grid: [n, d] float.
        block: the Hadamard block size used to quantize.

    Returns:
        [..., F] float32.
    """
    g = grid.to(device=codes.device, dtype=torch.float32)
    y = g[codes.long()].flatten(-2)  # [..., F/d, d] -> [..., F]
    return hadamard(y * (scale.float() / math.sqrt(y.shape[-1])), block)


def main(argv: list[str] | None = None) -> None:
    """Regenerate the shipped grid file (or write it to the path given as the only argument)."""
    from safetensors.torch import save_file

    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else GRID_FILE
    grids = {}
    for dim, points in GRIDS:
        start = time.perf_counter()
        grids[grid_key(points, dim)] = lloyd_grid(points, dim, samples=GRID_SAMPLES, iters=GRID_ITERS, seed=GRID_SEED)
        print(f"dim={dim} points={points}: {time.perf_counter() - start:.1f} s", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    # one metadata entry: safetensors writes several in no fixed order, and the file must be byte-identical
    settings = f"lloyd_grid samples={GRID_SAMPLES} iters={GRID_ITERS} seed={GRID_SEED} relax={_RELAX}"
    save_file(grids, out, metadata={"generator": settings})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
