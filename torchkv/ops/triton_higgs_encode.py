"""HIGGS encoding (`higgs.higgs_quantize`'s rotation and nearest grid point) as one Triton kernel, beside its eager
reference.

Each row `x ∈ R^F` with its inverse scale `a = √F/‖x‖` (0 for a zero row) becomes `y = a·x·H` (H: the orthonormal
block-diagonal Walsh–Hadamard matrix with blocks of B), cut into F/d vectors of d, each replaced by the index of
its nearest grid point `argmax_j (2 y·c_j − ‖c_j‖²)`. Program (row block, Hadamard block) loads its
`[BLOCK_M, B]` slice, rotates it with one dot against H_B (entries `(−1)^popcount(i & j)/√B`, computed in
registers), and scans the n grid points one at a time with a running arg-max per d-vector. The `[rows, F/d, n]`
scores never exist in memory, and no rotated copy of x is written.

Registered with `torch.library.custom_op`, so torch.compile keeps it as one opaque call and CUDA graphs capture
it. On CPU tensors it runs only under Triton's interpreter (`TRITON_INTERPRET=1`), which tests use.
"""

import math

import torch

from torchkv.ops import triton_decode
from torchkv.ops.hadamard import hadamard
from torchkv.ops.triton_decode import triton

#: rows per program: [32, B] floats of x and [32, B/d] running maxima and codes stay in registers
BLOCK_M = 32
#: the largest grid the kernel scans (its codes are bytes)
MAX_POINTS = 256
#: the largest Hadamard block: the dot's [B, B] float32 operand is 64 KB of shared memory at 128 (a 256-wide block,
#: 256 KB, would not fit an H100's 228 KB)
MAX_BLOCK = 128


def higgs_encode_reference(x: torch.Tensor, inv: torch.Tensor, grid: torch.Tensor, block: int) -> torch.Tensor:
    """Eager reference of `higgs_encode`: every distance `‖y_k − c_j‖²` formed, `[M, F/d, n]` (for tests only).
    Shapes as `higgs_encode`."""
    y = hadamard(x.float(), block) * inv[:, None]
    vectors = y.unflatten(-1, (-1, grid.shape[-1]))  # [M, F/d, d]
    return (vectors[..., None, :] - grid).square().sum(-1).argmin(-1).to(torch.uint8)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _hadamard_block(norm, B: tl.constexpr, B_PAD: tl.constexpr):
        """H_B [B_PAD, B_PAD] float32, zero outside [B, B]: `(−1)^popcount(i & j)·norm` (Sylvester's order; norm
        = 1/√B)."""
        i = tl.arange(0, B_PAD)
        bits = i[:, None] & i[None, :]
        for shift in tl.static_range(4, -1, -1):  # fold the 32 bits of i & j onto bit 0: their parity
            bits = bits ^ (bits >> (1 << shift))
        sign = 1.0 - 2.0 * (bits & 1).to(tl.float32)
        inside = (i < B)[:, None] & (i < B)[None, :]
        return tl.where(inside, sign * norm, 0.0)

    @triton.jit
    def _encode_kernel(x, inv, grid, codes, M, N, F, K, norm,
                       B: tl.constexpr, B_PAD: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        block = tl.program_id(1)
        row_ok = rows < M
        col = tl.arange(0, B_PAD)
        xs = tl.load(x + rows[:, None] * F + block * B + col[None, :], mask=row_ok[:, None] & (col < B)[None, :],
                     other=0.0)
        a = tl.load(inv + rows, mask=row_ok, other=0.0)
        y = tl.dot(xs, _hadamard_block(norm, B, B_PAD), input_precision="ieee") * a[:, None]  # [BLOCK_M, B_PAD]
        y = tl.reshape(y, (BLOCK_M, B_PAD // D, D))
        j = tl.arange(0, D)
        best = tl.full((BLOCK_M, B_PAD // D), float("-inf"), tl.float32)
        code = tl.zeros((BLOCK_M, B_PAD // D), tl.int32)
        for n in range(N):  # ties keep the lowest index, as `higgs.nearest`
            point = tl.load(grid + n * D + j)
            score = tl.sum(y * (2.0 * point)[None, None, :], 2) - tl.sum(point * point, 0)
            better = score > best
            best = tl.where(better, score, best)
            code = tl.where(better, n, code)
        group = tl.arange(0, B_PAD // D)
        ok = row_ok[:, None] & (group < B // D)[None, :]
        tl.store(codes + rows[:, None] * K + block * (B // D) + group[None, :], code.to(tl.uint8), mask=ok)


def runs_on(x: torch.Tensor, grid: torch.Tensor, block: int) -> bool:
    """Encoding of `x` on its device runs this kernel: CUDA with Triton, a grid of at most `MAX_POINTS` and Hadamard
    blocks of at most `MAX_BLOCK` (others take the eager path)."""
    return triton_decode.runs_on(x.device) and grid.shape[0] <= MAX_POINTS and block <= MAX_BLOCK


@torch.library.custom_op("torchkv::higgs_encode", mutates_args=())
def higgs_encode(x: torch.Tensor, inv: torch.Tensor, grid: torch.Tensor, block: int) -> torch.Tensor:
    """Nearest grid points of the rows of `x`, rotated and scaled.

    Args:
        x: [M, F] float32 rows; inv: [M] float32, each row's factor `√F/‖x‖` (0 for a zero row).
        grid: [n, d] float32, n ≤ 256, d a power of two dividing `block`.
        block: the Hadamard block size, a power of two dividing F, at most `MAX_BLOCK`.

    Returns:
        [M, F/d] uint8 grid indices, those of `nearest(hadamard(x, block)·inv, grid)`.
    """
    m, f = x.shape
    n, d = grid.shape
    out = torch.empty(m, f // d, dtype=torch.uint8, device=x.device)
    if m:
        _encode_kernel[(triton.cdiv(m, BLOCK_M), f // block)](
            x.contiguous(), inv.contiguous(), grid.contiguous(), out, m, n, f, f // d, 1 / math.sqrt(block),
            B=block, B_PAD=max(16, block), D=d, BLOCK_M=BLOCK_M,
        )
    return out


@higgs_encode.register_fake
def _(x, inv, grid, block):
    return x.new_empty(x.shape[0], x.shape[1] // grid.shape[1], dtype=torch.uint8)
