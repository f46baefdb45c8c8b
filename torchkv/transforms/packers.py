"""Pack transforms: codes to dense bytes."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torchkv.ops import PACK_BITS, PLANAR_BITS, pack_bits, packed_size, unpack_bits
from torchkv.registry import register_transform
from torchkv.transforms.base import Context, Transform, TransformConfig


@dataclass(frozen=True, kw_only=True)
class BitsConfig(TransformConfig):
    """bits: code width; None takes the width of the quantizer before it in the chain."""

    bits: int | None = None

    def __post_init__(self):
        if self.bits is not None and self.bits not in PACK_BITS:
            raise ValueError(f"pack.bits bits={self.bits} is not supported; allowed: {PACK_BITS}")


@register_transform("pack", "bits")
class PackBits(Transform):
    """Pack b-bit codes along the feature axis: `[B, H, T, F]` uint8 -> `[B, H, T, ceil(F·b/8)]` uint8."""

    Config = BitsConfig

    @property
    def bits(self) -> int:
        if self.config.bits is None:
            raise ValueError("pack.bits has no width: put it after a quantizer or pass bits=...")
        return self.config.bits

    @property
    def planar(self) -> bool:
        """Planar layout: decode attention can read the codes without unpacking them first."""
        return self.bits in PLANAR_BITS

    def out_dim(self, dim: int) -> int:
        return packed_size(dim, self.bits)

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return pack_bits(x, self.bits), {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        return unpack_bits(y, self.bits, ctx.dim)
