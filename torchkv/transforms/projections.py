"""Project transforms that are not tied to one method: diagonal maps of the feature axis."""

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from torchkv.registry import register_transform
from torchkv.transforms.base import LATER_OPTION, Context, Transform, TransformConfig


def _channel_rms(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """`x: [B, H, R, T, F]` -> root mean square over rows R and valid tokens T: `[B, H, 1, F]` float32.

    The sum over tokens is one matrix-vector product per sequence over `[T, H·R·F]` rows, the memory order of a
    model's projections (heads transposed after the tokens): reduced in place over that layout, the sum took
    16 ms per layer at 4K tokens on CPU, the product takes 1.5."""
    b, h, r, t, f = x.shape
    weight = x.new_ones(b, t, dtype=torch.float32) if valid is None else valid.float()  # [B, T]
    count = weight.sum(1).clamp_min(1)[:, None, None] * r  # [B, 1, 1]
    squares = x.float().permute(0, 3, 1, 2, 4).square().reshape(b, t, h * r * f)  # [B, T, H·R·F]
    total = (weight[:, None] @ squares).view(b, h, r, f).sum(2)  # [B, H, F]
    return (total / count).sqrt()[:, :, None]


def _pair_rms(rms: torch.Tensor) -> torch.Tensor:
    """`[..., F]` -> the root mean square of each rotary pair (c, c + F/2), repeated on both: `[..., F]`."""
    half = rms.shape[-1] // 2
    pooled = ((rms[..., :half].square() + rms[..., half:].square()) / 2).sqrt()
    return torch.cat([pooled, pooled], -1)


def _second_moment(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """`x: [B, H, R, T, F]` -> `E[x xᵀ]` over rows R and valid tokens T: `[B, H, F, F]` float32."""
    b, h, r, t, f = x.shape
    rows = x.float().flatten(2, 3)  # [B, H, R·T, F]
    if valid is not None:
        rows = rows * valid[:, None, None, :].expand(b, h, r, t).reshape(b, h, r * t, 1)
    count = (t if valid is None else valid.sum(1).clamp_min(1)) * r
    return rows.transpose(-1, -2) @ rows / torch.as_tensor(count, dtype=torch.float32).reshape(-1, 1, 1, 1)


@dataclass(frozen=True, kw_only=True)
class BalanceConfig(TransformConfig):
    """moment: also prepare the balanced prompt queries' second moment, which a `quantize.higgs` with
    `query_metric=True` after it chooses its codes under."""

    moment: bool = field(default=False, metadata={LATER_OPTION: True})


@register_transform("project", "balance")
class Balance(Transform):
    """Scale key channel c by `w_c = (rms q_c / rms k_c)^½` over the prompt and queries by `1/w`: scores are
    unchanged (`q·k = (q/w)·(k⊙w)`), and the error of a per-token code that comes after it is spread where the
    queries weigh it least. A code whose error is white in the scaled space (a rotation then one norm per row)
    has score error variance `∝ Σ_c (E q_c² / w_c²) · Σ_c w_c² E k_c²`, which this `w` minimises
    (Cauchy–Schwarz); it is normalised to a geometric mean of 1. Both channels of a rotary pair (c, c + F/2)
    share one scale from their pooled rms: RoPE turns each pair by a position-dependent angle, so a post-RoPE
    channel's own rms drifts along the sequence (a slow pair barely turns over a short prompt, then grows
    later: per-channel scales from a 64-token prompt cost SmolLM2 +180% perplexity at 8K), while the pair's
    energy does not, and a scale shared by the pair commutes with RoPE.

    prepare: keys `x: [B, H, T, F]` and the prompt's queries `[B, Hq, T, F]` (query head i reads KV head
    i // (Hq/H); pads excluded) -> "balance" `w` `[B, H, 1, F]` float32 and, with `moment`, "query_moment"
    `E[(q/w)(q/w)ᵀ]` `[B, H, F, F]` float32.
    encode: `x ⊙ w`; decode: `y / w`; decode attention reads the scaled form through `map_query` `q / w`.
    """

    Config = BalanceConfig
    needs_prepare = True
    requires = frozenset({"queries"})
    prepares = frozenset({"balance"})
    linear = True

    def __init__(self, **config):
        super().__init__(**config)
        if self.config.moment:
            self.prepares = frozenset({"balance", "query_moment"})

    def prepare(self, x: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
        if x.shape[-1] % 2:
            raise ValueError(f"project.balance pairs rotary channels (c, c + F/2): F={x.shape[-1]} must be even")
        queries = self.prompt_queries(x, ctx)
        q_rms = _pair_rms(_channel_rms(queries, ctx.valid))
        k_rms = _pair_rms(_channel_rms(x[:, :, None], ctx.valid))
        floor = 1e-6 * torch.maximum(q_rms.amax(-1, keepdim=True), k_rms.amax(-1, keepdim=True)).clamp_min(1e-30)
        log_w = 0.5 * (q_rms.clamp_min(floor).log() - k_rms.clamp_min(floor).log())
        w = (log_w - log_w.mean(-1, keepdim=True)).exp()
        if not self.config.moment:
            return {"balance": w}
        return {"balance": w, "query_moment": _second_moment(queries / w[:, :, None], ctx.valid)}

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x.float() * ctx.prepared["balance"], {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        return y.float() / ctx.prepared["balance"]

    def map_query(self, q: torch.Tensor, ctx: Context) -> torch.Tensor:
        return q.float() / ctx.prepared["balance"]

    def map_output(self, o: torch.Tensor, total: torch.Tensor, ctx: Context) -> torch.Tensor:
        return o / ctx.prepared["balance"]
