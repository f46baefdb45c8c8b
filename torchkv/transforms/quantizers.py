"""Quantize transforms: uniform affine (per-token / per-channel groups) and plain dtype casts."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torchkv.ops import SUPPORTED_BITS, dequantize, quantize
from torchkv.ops.decode import affine_scores, affine_weighted_sum, code_planes
from torchkv.registry import register_transform
from torchkv.transforms.base import Context, Transform, TransformConfig

AXES = ("token", "channel")
META_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CAST_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True, kw_only=True)
class UniformConfig(TransformConfig):
    """bits: code width; axis: "token" (groups of channels) or "channel" (groups of tokens);
    group: elements per group; symmetric: no zero point; meta_dtype: dtype of scale/zero."""

    bits: int
    axis: str = "token"
    group: int = 32
    symmetric: bool = False
    meta_dtype: str = "float16"

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"quantize.uniform bits={self.bits} is not supported; allowed: {SUPPORTED_BITS}")
        if self.axis not in AXES:
            raise ValueError(f"quantize.uniform axis={self.axis!r} is not supported; allowed: {AXES}")
        if self.group < 1:
            raise ValueError(f"quantize.uniform group={self.group} must be a positive integer")
        if self.meta_dtype not in META_DTYPES:
            raise ValueError(f"quantize.uniform meta_dtype={self.meta_dtype!r}; allowed: {sorted(META_DTYPES)}")


@register_transform("quantize", "uniform")
class UniformQuantize(Transform):
    """Uniform affine round-to-nearest quantization (KIVI: keys per channel, values per token).

    encode: `x: [B, H, T, F]` -> codes `[B, H, T, F]` uint8, state scale/zero
    `[B, H, T, F/G]` (axis="token") or `[B, H, T/G, F]` (axis="channel").
    Padding tokens (`ctx.valid`) stay out of per-channel statistics.
    """

    Config = UniformConfig

    @property
    def token_multiple(self) -> int:
        return self.config.group if self.config.axis == "channel" else 1

    @property
    def code_bits(self) -> int:
        return self.config.bits

    def _dim(self) -> int:
        return -1 if self.config.axis == "token" else -2

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        if cfg.axis == "token" and ctx.dim % cfg.group:
            raise ValueError(
                f"quantize.uniform group={cfg.group} must divide the feature size {ctx.dim} for axis='token'"
            )
        valid = None
        if cfg.axis == "channel" and ctx.valid is not None:
            valid = ctx.valid[:, None, :, None]  # [B, 1, T, 1]
        codes, scale, zero = quantize(
            x, cfg.bits, self._dim(), cfg.group, cfg.symmetric, META_DTYPES[cfg.meta_dtype], valid
        )
        state = {"scale": scale} if zero is None else {"scale": scale, "zero": zero}
        return codes, state

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        cfg = self.config
        return dequantize(y, state["scale"], state.get("zero"), cfg.bits, self._dim(), cfg.group)

    def scores(self, q: torch.Tensor, packed: torch.Tensor, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Decode attention scores read from planar-packed codes.

        Args:
            q: [B, H, g, F] float32. packed: [B, H, NC, C, M] uint8; state viewed by chunk likewise.

        Returns:
            [B, H, g, NC, C] float32.
        """
        cfg = self.config
        planes = code_planes(packed, cfg.bits)
        return affine_scores(q, planes, state["scale"], state.get("zero"), cfg.bits, cfg.axis)

    def weighted_sum(
        self, p: torch.Tensor, packed: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context
    ) -> torch.Tensor:
        """`Σ_t p_t x̂_t` read from planar-packed codes: p [B, H, g, NC, C] -> [B, H, g, F] float32."""
        cfg = self.config
        planes = code_planes(packed, cfg.bits)
        return affine_weighted_sum(p, planes, state["scale"], state.get("zero"), cfg.bits, cfg.axis, ctx.dim)


@dataclass(frozen=True, kw_only=True)
class CastConfig(TransformConfig):
    """dtype: storage dtype name."""

    dtype: str = "float16"

    def __post_init__(self):
        if self.dtype not in CAST_DTYPES:
            raise ValueError(f"quantize.cast dtype={self.dtype!r} is not supported; allowed: {sorted(CAST_DTYPES)}")


@register_transform("quantize", "cast")
class Cast(Transform):
    """Store in a floating dtype (fp16 is the no-compression reference; float32 is lossless): `x -> x.to(dtype)`."""

    Config = CastConfig

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x.to(CAST_DTYPES[self.config.dtype]), {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        return y.float()
