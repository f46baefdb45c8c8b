"""Pack transforms: codes to dense bytes."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torchkv.ops import PACK_BITS, PLANAR_BITS, pack_bits, packed_size, unpack_bits
from torchkv.registry import register_transform
from torchkv.transforms.base import Context, Transform, TransformConfig


@dataclass(frozen=True, kw_only=True)
class BitsConfig(TransformConfig):
    """bits: code width, or one width per equal group of features (mixed precision, e.g. SVDq's
    schedules); None takes the width(s) of the quantizer before it in the chain."""

    bits: int | tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.bits, list):  # from JSON
            object.__setattr__(self, "bits", tuple(self.bits))
        widths = self.bits if isinstance(self.bits, tuple) else (self.bits,)
        if self.bits is not None and (not widths or any(b not in PACK_BITS for b in widths)):
            raise ValueError(f"pack.bits bits={self.bits} is not supported; each width must be one of {PACK_BITS}")


@register_transform("pack", "bits")
class PackBits(Transform):
    """Pack b-bit codes along the feature axis: `[B, H, T, F]` uint8 -> `[B, H, T, ceil(F·b/8)]` uint8.
    With widths `(b_1..b_n)`, the F features are n equal groups, each packed at its own width and the
    bytes concatenated: `[B, H, T, Σ_i ceil(F/n·b_i/8)]`."""

    Config = BitsConfig

    @property
    def bits(self) -> int | tuple[int, ...]:
        if self.config.bits is None:
            raise ValueError("pack.bits has no width: put it after a quantizer or pass bits=...")
        return self.config.bits

    @property
    def planar(self) -> bool:
        """Planar layout: decode attention can read the codes without unpacking them first."""
        return self.bits in PLANAR_BITS

    def _groups(self, dim: int) -> list[tuple[int, int]]:
        """(features, width) of each group."""
        if isinstance(self.bits, int):
            return [(dim, self.bits)]
        if dim % len(self.bits):
            raise ValueError(f"pack.bits: {len(self.bits)} width groups do not divide {dim} features")
        return [(dim // len(self.bits), b) for b in self.bits]

    def out_dim(self, dim: int) -> int:
        return sum(packed_size(n, b) for n, b in self._groups(dim))

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        groups = self._groups(x.shape[-1])
        parts = x.split([n for n, _ in groups], -1)
        return torch.cat([pack_bits(p, b) for p, (_, b) in zip(parts, groups)], -1), {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        groups = self._groups(ctx.dim)
        parts = y.split([packed_size(n, b) for n, b in groups], -1)
        return torch.cat([unpack_bits(p, b, n) for p, (n, b) in zip(parts, groups)], -1)
