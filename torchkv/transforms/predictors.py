"""Predict transforms: subtract what other reconstructions of the same token predict, keep the residual."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torchkv.registry import register_transform
from torchkv.transforms.base import Context, Transform, TransformConfig
from torchkv.transforms.quantizers import META_DTYPES

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
        if self.weight_dtype not in META_DTYPES:
            raise ValueError(f"predict.linear weight_dtype={self.weight_dtype!r}; allowed: {sorted(META_DTYPES)}")


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
