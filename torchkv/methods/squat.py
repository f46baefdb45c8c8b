"""SQuat (Wang et al., 2025, arXiv 2503.24358): key error kept (nearly) orthogonal to the prompt's queries.

Keys: a `project.query_subspace` transform builds Q̂ per layer and KV head from the prompt's queries
and the block correction matrices; `quantize.squat` quantizes per channel, g channels at a time, with
the closed-form correction of the channels not yet quantized. The stored codes are KIVI's per-channel
affine codes, so decode attention reads them exactly as it reads KIVI's. Values: KIVI per token.
`squat-pre-*` stores pre-RoPE keys (SQuat^pre) and applies RoPE at each token's position on decode.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

import torchkv.transforms as T
from torchkv.ops.squat import block_updates, query_subspace, squat_quantize
from torchkv.pipeline import KVPipeline
from torchkv.registry import register_preset, register_transform
from torchkv.transforms import Context, Transform, TransformConfig
from torchkv.transforms.quantizers import META_DTYPES, UniformConfig, UniformQuantize


@dataclass(frozen=True, kw_only=True)
class QuerySubspaceConfig(TransformConfig):
    """rank: r, singular directions kept; lam: λ ≥ 0, weight of `‖Q̂δ‖²`; block: g, channels quantized
    per step (None: head_dim/2, the paper's 64 of 128); shared: one subspace from the batch's first row
    (SQuat App. D) instead of one per row."""

    rank: int = 5
    lam: float = 1e-3
    block: int | None = None
    shared: bool = False

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"project.query_subspace rank={self.rank!r} must be a non-negative integer")
        if not self.lam >= 0:
            raise ValueError(f"project.query_subspace lam={self.lam!r} must be >= 0")
        if self.block is not None and (not isinstance(self.block, int) or self.block < 1):
            raise ValueError(f"project.query_subspace block={self.block!r} must be a positive integer or None")


@register_transform("project", "query_subspace")
class QuerySubspace(Transform):
    """SQuat's query subspace (§3.2–3.3): leaves the keys as they are and prepares, from the prompt's
    queries, the correction matrices the `quantize.squat` after it applies.

    prepare: queries `[B, Hq, T, D]` (query head i reads KV head i // (Hq/H); pads excluded) ->
    "updates" `[B, H, Σ_t (D - t·g), g]` float32 (see `ops.squat.block_updates`).
    encode/decode: the identity on `[B, H, T, D]`.
    """

    Config = QuerySubspaceConfig
    needs_prepare = True
    requires = frozenset({"queries"})
    prepares = frozenset({"updates"})
    linear = True

    def prepare(self, x: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
        grouped = self.prompt_queries(x, ctx)  # [B, H, n_rep, T, D]
        b, h, n_rep, t, d = grouped.shape
        cfg = self.config
        rows = grouped.flatten(2, 3)  # [B, H, n_rep·T, D], GQA heads stacked
        valid = None
        if ctx.valid is not None:
            valid = ctx.valid[:, None, None, :].expand(b, h, n_rep, t).reshape(b, h, -1)
        if cfg.shared:
            rows, valid = rows[:1], None if valid is None else valid[:1]
        updates = block_updates(query_subspace(rows, cfg.rank, valid), cfg.lam, cfg.block or d // 2)
        return {"updates": updates.expand(b, *updates.shape[1:]) if cfg.shared else updates}

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x, {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        return y

    def map_query(self, q: torch.Tensor, ctx: Context) -> torch.Tensor:
        return q

    def map_output(self, o: torch.Tensor, total: torch.Tensor, ctx: Context) -> torch.Tensor:
        return o


@dataclass(frozen=True, kw_only=True)
class SquatConfig(UniformConfig):
    """bits: code width; group: G, tokens per scale/zero of each channel; meta_dtype: dtype of scale/zero."""

    axis: str = "channel"

    def __post_init__(self):
        super().__post_init__()
        if self.axis != "channel" or self.symmetric:
            raise ValueError("quantize.squat quantizes keys per channel and asymmetrically (axis='channel')")


@register_transform("quantize", "squat")
class SquatQuantize(UniformQuantize):
    """Per-channel key quantization with SQuat's block-wise correction (Alg. 1 QUANT, Eq. 6).

    encode: `x: [B, H, T, D]` -> codes `[B, H, T, D]` uint8, scale/zero `[B, H, T/G, D]`, reading the
    "updates" prepared by a `project.query_subspace` before it. decode and decode attention: those of
    per-channel `quantize.uniform`, since the codes are the same affine codes.
    """

    Config = SquatConfig
    reads_upstream = frozenset({"updates"})

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        valid = None if ctx.valid is None else ctx.valid[:, None, :, None]  # [B, 1, T, 1]
        codes, scale, zero = squat_quantize(
            x, ctx.upstream["updates"], cfg.bits, cfg.group, META_DTYPES[cfg.meta_dtype], valid
        )
        return codes, {"scale": scale, "zero": zero}


def squat(
    bits: int = 2,
    rank: int = 5,
    lam: float = 1e-3,
    block: int | None = None,
    group: int = 32,
    residual: int = 32,
    shared: bool = False,
    pre_rope: bool = False,
) -> KVPipeline:
    """SQuat keys (post-RoPE, or pre-RoPE with `pre_rope`), KIVI values; paper defaults (App. E.2)."""
    keys = [
        T.project("query_subspace", rank=rank, lam=lam, block=block, shared=shared),
        T.quantize("squat", bits=bits, group=group),
        T.pack(),
    ]
    return KVPipeline(
        keys=[T.rotate("pre_rope"), *keys] if pre_rope else keys,
        values=[T.quantize(bits=bits, axis="token", group=group), T.pack()],
        residual=residual,
    )


@register_preset(
    "squat-2bit", description="SQuat 2-bit: post-RoPE keys, error kept out of the prompt's query subspace",
    nominal_bits=2.0,
)
def squat_2bit(
    rank: int = 5, lam: float = 1e-3, block: int | None = None, group: int = 32, residual: int = 32,
    shared: bool = False,
) -> KVPipeline:
    return squat(2, rank, lam, block, group, residual, shared)


@register_preset(
    "squat-pre-2bit", description="SQuat^pre 2-bit: pre-RoPE keys (RoPE re-applied on decode)", nominal_bits=2.0,
)
def squat_pre_2bit(
    rank: int = 5, lam: float = 1e-3, block: int | None = None, group: int = 32, residual: int = 32,
    shared: bool = False,
) -> KVPipeline:
    return squat(2, rank, lam, block, group, residual, shared, pre_rope=True)
