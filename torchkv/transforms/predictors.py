"""Predict transforms: subtract what other reconstructions of the same token predict, keep the residual."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torchkv.ops import apply_rope, turned_dot, turned_dot_by_chunk, weight_factors
from torchkv.registry import register_transform
from torchkv.transforms.base import Context, ProjectionWeights, Transform, TransformConfig
from torchkv.transforms.quantizers import META_DTYPES, check_meta_dtype
from torchkv.transforms.rotations import rope_tables

#: what a prediction may read: the previous layer's reconstruction of this chain's tokens, and (value chain)
#: this layer's reconstructed keys, both in projection space (see `KVPipeline.carries`)
SOURCES = ("keys", "previous")


@dataclass(frozen=True, kw_only=True)
class LinearPredictConfig(TransformConfig):
    """sources: the reconstructions the prediction reads, concatenated in this order (AQUA-KV: keys from
    ("previous",), values from ("keys", "previous")); weight_dtype: storage dtype of the fitted weights."""

    sources: tuple[str, ...] = ("previous",)
    weight_dtype: str = "float16"

    def __post_init__(self):
        object.__setattr__(self, "sources", tuple(self.sources))
        if not self.sources or set(self.sources) - set(SOURCES) or len(set(self.sources)) < len(self.sources):
            raise ValueError(f"predict.linear sources={self.sources!r}: distinct names among {SOURCES}")
        check_meta_dtype("predict.linear", "weight_dtype", self.weight_dtype)


@register_transform("predict", "linear")
class LinearPredict(Transform):
    """Linear prediction with bias from other reconstructions of the same token (AQUA-KV §3.2, Alg. 2/3):
    `R = X − (Z·W + b)` with `Z = [sources]`, each source's heads and features flattened per token.

    encode: `x: [B, H, T, F]` -> residual `[B, H, T, F]` float32; decode adds the prediction back, so the
    reconstruction error is the next transforms' error on the residual.
    params per layer (set by `fit_layer`): "weight" `[Σ H·F of sources, H·F]`, "bias" `[H·F]`. A layer
    without them, or without its sources (layer 0 has no previous layer), predicts zero.
    """

    Config = LinearPredictConfig
    needs_fit = True

    def __init__(self, **config):
        super().__init__(**config)
        self.requires = frozenset(self.config.sources)

    def features(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The prediction's input `Z`: `[B, T, Σ H·F]` float32 from `[B, H, T, F]` sources."""
        parts = [inputs[s].float().transpose(1, 2) for s in self.config.sources]  # [B, T, H, F]
        return torch.cat([p.flatten(2) for p in parts], -1)

    def _prediction(self, shape: torch.Size, ctx: Context) -> torch.Tensor | None:
        if "weight" not in ctx.params or any(s not in ctx.inputs for s in self.config.sources):
            return None
        b, h, t, f = shape
        p = self.features(ctx.inputs) @ ctx.params["weight"].float() + ctx.params["bias"].float()  # [B, T, H·F]
        return p.view(b, t, h, f).transpose(1, 2)

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        p = self._prediction(x.shape, ctx)
        return (x.float() if p is None else x.float() - p), {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        p = self._prediction(y.shape, ctx)
        return y.float() if p is None else y.float() + p

    def fit_layer(self, layer: int, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Set one layer's predictor `ŷ = z·weight + bias` (`weight: [Din, Dout]`), stored in `weight_dtype`."""
        dtype = META_DTYPES[self.config.weight_dtype]
        self.params[f"{layer}.weight"] = weight.to(dtype).contiguous()
        self.params[f"{layer}.bias"] = bias.to(dtype).contiguous()


@dataclass(frozen=True, kw_only=True)
class DeltaConfig(TransformConfig):
    """subspace: keep only the delta's coordinates in the span of the layer's `[W_k | W_v]` (XQuant-CL for GQA,
    §1.5), an orthonormal basis fitted from the weights; basis_dtype: storage dtype of that basis."""

    subspace: bool = False
    basis_dtype: str = "float16"

    def __post_init__(self):
        check_meta_dtype("predict.delta", "basis_dtype", self.basis_dtype)


@register_transform("predict", "delta")
class DeltaPredict(Transform):
    """Error-feedback delta against the previous layer's reconstruction (XQuant-CL §1.4–1.5, the running
    accumulator): encode `δ = x − x̂_{ℓ−1}`, decode `x̂_ℓ = x̂_{ℓ−1} + δ̂`, which the next layer reads as its
    "previous". With `subspace`, `δ·U_kv` is kept (`[B, H, T, F]` -> `[B, H, T, 2·d_kv]`) and decode adds
    `δ̂·U_kvᵀ`: keys and values `x̂_ℓ·W_kv` are exact for an exact `δ̂` although `x̂_ℓ` drifts from `x` (P8).
    Without a previous reconstruction the prediction is 0. params per layer (subspace): "basis" `[F, 2·d_kv]`.
    """

    Config = DeltaConfig
    requires = frozenset({"previous"})
    fits_weights = True

    def __init__(self, **config):
        super().__init__(**config)
        self.width: int | None = None  # of the kept subspace, set by `fit_weights`

    def out_dim(self, dim: int) -> int:
        if not self.config.subspace:
            return dim
        if self.width is None:
            raise ValueError("predict.delta(subspace=True) has no basis yet: specialize the pipeline with "
                             "pipe.for_model(model)")
        return self.width

    def fit_weights(self, layer: int, weights: ProjectionWeights) -> None:
        if self.config.subspace:
            basis, _ = weight_factors(torch.cat([weights.k, weights.v], 1))  # [d, 2·d_kv] (thin)
            self.params[f"{layer}.basis"] = basis.to(META_DTYPES[self.config.basis_dtype]).contiguous()
            self.width = basis.shape[1]

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        delta = x.float() - ctx.inputs["previous"].float() if "previous" in ctx.inputs else x.float()
        return (delta @ ctx.params["basis"].float() if self.config.subspace else delta), {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        delta = y.float() @ ctx.params["basis"].float().T if self.config.subspace else y.float()
        return delta + ctx.inputs["previous"].float() if "previous" in ctx.inputs else delta


@register_transform("predict", "center")
class Center(Transform):
    """Predict every token by its channels' medians over the prompt, and keep the residual `x − μ`.

    Keys of models that normalize them (`k_norm`: Gemma 3, Qwen3, OLMo 2) carry large per-channel offsets,
    on which a per-token code (HIGGS' one norm per row) would spend its bits; the prompt's median (robust to
    attention-sink tokens) removes them at no stored cost.

    prepare: `x: [B, H, T, F]` -> "center" `[B, H, 1, F]` float32 (pads excluded).
    encode: `x − μ`; decode: `y + μ`. Decode attention reads the residual's stored form: `q·x = q·(x − μ) + q·μ`
    (`score_offset`) and `Σ_t p_t x_t = Σ_t p_t (x_t − μ) + μ·Σ_t p_t`.
    """

    needs_prepare = True
    prepares = frozenset({"center"})
    linear = True

    def prepare(self, x: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
        return {"center": _channel_medians(x, ctx.valid)}

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x.float() - ctx.prepared["center"], {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        return y.float() + ctx.prepared["center"]

    def map_query(self, q: torch.Tensor, ctx: Context) -> torch.Tensor:
        return q

    def score_offset(self, q: torch.Tensor, ctx: Context) -> torch.Tensor:
        return (q * ctx.prepared["center"]).sum(-1, keepdim=True)  # [B, H, g, 1]

    def map_output(self, o: torch.Tensor, total: torch.Tensor, ctx: Context) -> torch.Tensor:
        return o + total * ctx.prepared["center"]


def _channel_medians(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Per-channel medians over tokens of `x: [B, H, T, F]`, pads (`valid` False) excluded: `[B, H, 1, F]`."""
    x = x.float()
    if valid is not None:
        x = x.masked_fill(~valid[:, None, :, None], float("nan"))
    return x.nanmedian(2, keepdim=True).values.nan_to_num(0.0)


@register_transform("predict", "rotary_center")
class RotaryCenter(Transform):
    """Predict every post-RoPE key by its head's median pre-RoPE key over the prompt turned to the key's position,
    `R_t·μ`, and keep the residual `x − R_t·μ`.

    A key channel pair with a large mean turns with RoPE over the context, so no fixed offset removes it
    (`predict.center` gains at 2K and loses at 8K); turned with the token it is removed at every position, and a
    per-token code (HIGGS' one norm per row) spends its bits on what varies.

    prepare: post-RoPE prompt keys `x: [B, H, T, D]` and their "cos"/"sin" -> "center" `[B, H, 1, D]` float32,
    the medians of `R_t⁻¹·x` (pads excluded).
    encode: `x − R_t·μ`; decode: `y + R_t·μ`, with the tokens' "cos"/"sin" `[B, T, R]`. Decode attention scores
    the residual's stored form and adds `q·R_t·μ` per token (`score_offset`, 2R multiply-adds a token), from the
    tokens' cos/sin or, where positions run on within each chunk, from the tables at the chunks' anchors
    ("anchor_cos"/"anchor_sin" `[B, NC, R]`, "step_cos"/"step_sin" `[1, C, R]`: `ops.rope.turned_dot_by_chunk`);
    weighted sums of keys are not read.
    """

    needs_prepare = True
    prepares = frozenset({"center"})
    requires = frozenset({"cos", "sin"})
    linear = True
    offset_per_token = True

    @property
    def maps_output(self) -> bool:
        return False  # Σ_t p_t·R_t·μ is per token as well; decode attention never sums keys

    def prepare(self, x: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
        cos, sin = rope_tables(self, ctx)
        return {"center": _channel_medians(apply_rope(x, cos, -sin), ctx.valid)}

    def _turned(self, ctx: Context) -> torch.Tensor:
        """`R_t·μ` `[B, H, T, D]` for the tokens at hand."""
        cos, sin = rope_tables(self, ctx)
        center = ctx.prepared["center"]
        return apply_rope(center.expand(-1, -1, cos.shape[1], -1), cos, sin)

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x.float() - self._turned(ctx), {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        return y.float() + self._turned(ctx)

    def map_query(self, q: torch.Tensor, ctx: Context) -> torch.Tensor:
        return q

    def score_offset(self, q: torch.Tensor, ctx: Context) -> torch.Tensor:
        center = ctx.prepared["center"]
        if "anchor_cos" in ctx.inputs:
            tables = (ctx.inputs[n] for n in ("anchor_cos", "anchor_sin", "step_cos", "step_sin"))
            return turned_dot_by_chunk(q, center, *tables)  # [B, H, g, T]
        cos, sin = rope_tables(self, ctx)
        return turned_dot(q, center, cos, sin)  # [B, H, g, T]
