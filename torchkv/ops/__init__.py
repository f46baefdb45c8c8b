"""Pure tensor functions, compile-clean: no `.item()`, no branches on tensor values."""

from torchkv.ops.hadamard import hadamard, hadamard_block
from torchkv.ops.linalg import masked_pca, ridge, ridge_from_moments
from torchkv.ops.pack import PACK_BITS, PLANAR_BITS, pack_bits, packed_size, unpack_bits, unpack_planes
from torchkv.ops.quantize import SUPPORTED_BITS, dequantize, quantize
from torchkv.ops.rope import apply_rope

__all__ = [
    "PACK_BITS",
    "PLANAR_BITS",
    "SUPPORTED_BITS",
    "apply_rope",
    "dequantize",
    "hadamard",
    "hadamard_block",
    "masked_pca",
    "pack_bits",
    "packed_size",
    "quantize",
    "ridge",
    "ridge_from_moments",
    "unpack_bits",
    "unpack_planes",
]
