"""Rotate transforms: orthogonal maps of the feature axis."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torchkv.ops import apply_rope, hadamard
from torchkv.registry import register_transform
from torchkv.transforms.base import Context, Transform, TransformConfig


@dataclass(frozen=True, kw_only=True)
class HadamardConfig(TransformConfig):
    """block: Hadamard block size (power of two dividing F); None takes the largest one."""

    block: int | None = None

    def __post_init__(self):
        if self.block is not None and (self.block < 1 or self.block & (self.block - 1)):
            raise ValueError(f"rotate.hadamard block={self.block} must be a power of two")


@register_transform("rotate", "hadamard")
class HadamardRotate(Transform):
    """Orthonormal (block) Walsh–Hadamard rotation of the features: `x -> x·H/√n`, self-inverse.

    encode/decode: `[B, H, T, F]` float -> `[B, H, T, F]` float32.
    """

    Config = HadamardConfig
    linear = True

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return hadamard(x.float(), self.config.block), {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        return hadamard(y.float(), self.config.block)

    def map_query(self, q: torch.Tensor, ctx: Context) -> torch.Tensor:
        return hadamard(q.float(), self.config.block)  # q·x = (qH)·(xH), H orthogonal

    def map_output(self, o: torch.Tensor, total: torch.Tensor, ctx: Context) -> torch.Tensor:
        return hadamard(o.float(), self.config.block)  # H is its own inverse


@register_transform("rotate", "pre_rope")
class PreRope(Transform):
    """Store keys before RoPE: encode undoes the rotary embedding, decode re-applies it at each token's
    true position (SVDq, AQUA-KV and SQuat-pre quantize pre-RoPE keys).

    encode/decode: `[B, H, T, D]` -> `[B, H, T, D]` float32, with `ctx.inputs` "cos"/"sin" `[B, T, R]`.
    """

    requires = frozenset({"cos", "sin"})

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cos, sin = rope_tables(self, ctx)
        return apply_rope(x, cos, -sin), {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        cos, sin = rope_tables(self, ctx)
        return apply_rope(y, cos, sin)


def rope_tables(transform: Transform, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables "cos"/"sin" `[B, T, R]` of the tokens at hand, which `transform` requires."""
    if "cos" not in ctx.inputs or "sin" not in ctx.inputs:
        raise ValueError(
            f"{transform.kind}.{transform.name} needs the rotary tables of the tokens' positions: patch the model with "
            "torchkv.patch, or pass inputs={'cos': cos, 'sin': sin} ([batch, tokens, rotary_dim], the model's "
            f"rotary embedding) to KVPipeline.prepare/encode_chunk/decode_chunk; got inputs {sorted(ctx.inputs)}"
        )
    return ctx.inputs["cos"], ctx.inputs["sin"]
