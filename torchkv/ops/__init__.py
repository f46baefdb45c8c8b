"""Pure tensor functions, compile-clean: no `.item()`, no branches on tensor values."""

from torchkv.ops.hadamard import hadamard, hadamard_block
from torchkv.ops.higgs import (
    GRIDS,
    gaussian_mse,
    higgs_dequantize,
    higgs_quantize,
    lloyd_grid,
    load_grid,
    nearest,
    nearest_weighted,
)
from torchkv.ops.linalg import masked_pca, ridge, ridge_from_moments, ridge_streamed, weight_factors
from torchkv.ops.pack import PACK_BITS, PLANAR_BITS, pack_bits, packed_size, unpack_bits, unpack_planes
from torchkv.ops.quantize import GAUSSIAN_STEP, STEPS, SUPPORTED_BITS, dequantize, quantize
from torchkv.ops.rope import apply_rope, turned_dot, turned_dot_by_chunk

__all__ = [
    "GAUSSIAN_STEP",
    "GRIDS",
    "PACK_BITS",
    "PLANAR_BITS",
    "STEPS",
    "SUPPORTED_BITS",
    "apply_rope",
    "turned_dot",
    "turned_dot_by_chunk",
    "dequantize",
    "gaussian_mse",
    "hadamard",
    "hadamard_block",
    "higgs_dequantize",
    "higgs_quantize",
    "lloyd_grid",
    "load_grid",
    "masked_pca",
    "nearest",
    "nearest_weighted",
    "pack_bits",
    "packed_size",
    "quantize",
    "ridge",
    "ridge_from_moments",
    "ridge_streamed",
    "unpack_bits",
    "unpack_planes",
    "weight_factors",
]
