"""XQuant / XQuant-CL (Tomar, Hooper et al., 2025): cache a quantized function of each layer's attention input
X (after its norm) instead of keys and values, and rematerialize `K = X̂·W_k + b_k`, `V = X̂·W_v + b_v` on every
read, RoPE applied at the true positions. Nothing of K or V is stored for encoded tokens.

- MHA (§1.2, `attention="mha"`): the key chain caches X per token; the value chain stores nothing and
  rematerializes V from the key chain's X̂ (one d-wide tensor instead of two).
- GQA (§1.3, `attention="gqa"`): X is wider than K and V together, so each chain caches its latent
  `X·U` (U: left singular vectors of W, no calibration data): keys per channel, values per token, and
  rematerializes through `R = Σ·Bᵀ`. `outliers=1` keeps latent channel 0 of the keys in float16 (App. B).
- CL (§1.4–1.5, `xquant_cl`): layers after a base layer cache the delta `X_ℓ − X̂_{ℓ−1}` against the
  previous layer's reconstruction (error feedback, `predict.delta`), for GQA projected onto the span of
  `[W_k | W_v]`; `X̂_ℓ` is the running accumulator handed from layer to layer. The first `first_layers`
  layers are plain XQuant at `first_bits`, the last of them (for GQA storing X d-wide, spec A8) the base.

Decode attention rebuilds the keys (RoPE must be applied at each position) but sums the values in the latent:
`Σ_t p_t v̂_t = (Σ_t p_t ẑ_t)·R_h + b_h·Σ_t p_t` (`WeightsProject.map_output`), so no V of the history is formed.

`attention="auto"` picks MHA when `n_kv·head_dim == hidden_size`, else GQA, when the pipeline is specialized
to a model (`torchkv.patch`, `KVPipeline.for_model`); unspecialized it has the GQA form. Projection bases
are derived from the model's weights at that point (float16 by default; views of the model's own weights,
which hold no memory of their own, where a chain rematerializes through W itself).
"""

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

import torchkv.transforms as T
from torchkv._compat import config_head_dim
from torchkv.ops import weight_factors
from torchkv.pipeline import KVPipeline
from torchkv.registry import register_preset, register_transform
from torchkv.transforms import Context, ProjectionWeights, Transform, TransformConfig
from torchkv.transforms.quantizers import META_DTYPES, check_meta_dtype

SIDES = ("k", "v")
BASES = ("svd", "input")
SOURCES = ("x", "keys")
ATTENTION = ("auto", "mha", "gqa")


@dataclass(frozen=True, kw_only=True)
class WeightsConfig(TransformConfig):
    """side: the projection rematerialized, "k" or "v"; basis: "svd" (cache `X·U`, rematerialize through
    `R = Σ·Bᵀ`) or "input" (cache X itself, rematerialize through W); source: "x" (cache from the layer
    input) or "keys" (cache nothing: rematerialize from the key chain's carried X̂); outliers: leading latent
    channels (largest singular values) stored in float16 instead of passed on; basis_dtype: storage of U, R."""

    side: str = "k"
    basis: str = "svd"
    source: str = "x"
    outliers: int = 0
    basis_dtype: str = "float16"

    def __post_init__(self):
        for name, value, allowed in (("side", self.side, SIDES), ("basis", self.basis, BASES),
                                     ("source", self.source, SOURCES)):
            if value not in allowed:
                raise ValueError(f"project.weights {name}={value!r}; allowed: {allowed}")
        if self.source == "keys" and (self.basis != "input" or self.outliers):
            raise ValueError("project.weights source='keys' rematerializes from the key chain's X̂: basis='input', "
                             "no outliers")
        if self.outliers < 0:
            raise ValueError(f"project.weights outliers={self.outliers} must be >= 0")
        check_meta_dtype("project.weights", "basis_dtype", self.basis_dtype)


@register_transform("project", "weights")
class WeightsProject(Transform):
    """Cache a function of the layer input, rematerialize keys or values from it (XQuant §1.2–1.3).

    encode ignores its chain input (pre-RoPE K or V `[B, H, T, D]`) and reads `ctx.inputs["x"]` `[B, T, d]`:
    it returns `Z = X·U` ("svd", `[B, 1, T, r − outliers]` after the float16 "outliers" state `[B, 1, T, n]`)
    or `Z = X` ("input", `[B, 1, T, d]`); with source "keys" it returns `[B, 1, T, 0]` (nothing stored).
    decode: `Ẑ·R + b` or `X̂·W + b` -> `[B, H, T, D]` float32, X̂ being the key chain's carry for "keys", then
    the model's key norm where it has one (`rms_norm(·)·s`, per head or over all heads: `ProjectionWeights`).
    params per layer (`fit_weights`): "down" U `[d, r]` and "up" R `[r, H·D]` (svd), or "up" W `[d, H·D]`;
    "bias" `[H·D]` when the projection has one; "norm" s `[D]` or `[H·D]` for a key norm. W, the bias and s are
    taken from the model's weights.
    """

    Config = WeightsConfig
    reads_stored = frozenset({"weighted_sum"})
    fits_weights = True
    rematerializes = True

    def __init__(self, **config):
        super().__init__(**config)
        cfg = self.config
        self.requires = frozenset({"x"} if cfg.source == "x" else {"keys"})
        self.borrowed = frozenset({"bias", "norm"} if cfg.basis == "svd" else {"up", "bias", "norm"})
        self.width: int | None = None  # of the cached latent, set by `fit_weights`
        self.norm_eps = 0.0  # of the model's key norm, set by `fit_weights`

    def out_dim(self, dim: int) -> int:
        if self.config.source == "keys":
            return 0
        if self.width is None:
            raise ValueError("project.weights has not been fitted: specialize the pipeline to a model with "
                             "pipe.for_model(model) (torchkv.patch does)")
        return self.width - self.config.outliers

    def fit_weights(self, layer: int, weights: ProjectionWeights) -> None:
        w = weights.k if self.config.side == "k" else weights.v  # [d, H·D]
        bias = weights.k_bias if self.config.side == "k" else weights.v_bias
        params = {} if bias is None else {"bias": bias}
        if self.config.side == "k" and weights.k_norm is not None:
            params["norm"], self.norm_eps = weights.k_norm, weights.k_norm_eps
        if self.config.basis == "svd":
            down, up = weight_factors(w)
            dtype = META_DTYPES[self.config.basis_dtype]
            params.update(down=down.to(dtype).contiguous(), up=up.to(dtype).contiguous())
        else:
            params["up"] = w
        self.params.update({f"{layer}.{name}": t for name, t in params.items()})
        self.input_width = w.shape[0]
        self.width = params["up"].shape[0]

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        b, _, t, _ = x.shape
        if self.config.source == "keys":
            return x.new_zeros(b, 1, t, 0, dtype=torch.float32), {}
        z = ctx.inputs["x"].float()[:, None]  # [B, 1, T, d]
        if self.config.basis == "svd":
            z = z @ ctx.params["down"].float()
        n = self.config.outliers
        if not n:
            return z, {}
        return z[..., n:], {"outliers": z[..., :n].to(torch.float16)}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        z = ctx.inputs["keys"] if self.config.source == "keys" else y
        if self.config.outliers:
            z = torch.cat([state["outliers"], z], -1)
        out = z.float() @ ctx.params["up"].float()  # [B, 1, T, H·D]
        if "bias" in ctx.params:
            out = out + ctx.params["bias"].float()
        out = out[:, 0].unflatten(-1, (-1, ctx.dim))  # [B, T, H, D]
        if "norm" in ctx.params:
            per_head = ctx.params["norm"].shape[0] == ctx.dim  # Qwen3, Gemma 3; else over all heads (OLMo 2)
            out = _rms_norm(out if per_head else out.flatten(-2), ctx.params["norm"], self.norm_eps).view(out.shape)
        return out.transpose(1, 2)

    @property
    def maps_output(self) -> bool:
        return not self.config.outliers  # the float16 outlier channels are not part of the summed output

    def map_output(self, o: torch.Tensor, total: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Latent-space value sums (no V formed): `Σ_t p_t (ẑ_t·R + b) = (Σ_t p_t ẑ_t)·R_h + b_h·Σ_t p_t` per KV head
        h, o `[B, H, g, r]` -> `[B, H, g, D]`."""
        up = ctx.params["up"].float().unflatten(-1, (-1, ctx.dim))  # [r, H, D]
        out = torch.einsum("bhgr,rhd->bhgd", o.float(), up)
        if "bias" in ctx.params:
            out = out + total * ctx.params["bias"].float().view(-1, 1, ctx.dim)
        return out

    def weighted_sum(
        self, p: torch.Tensor, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context
    ) -> torch.Tensor:
        """`Σ_t p_t v_t` from what the chain stores (y `[B, 1, NC, C, r]`) or, source "keys", from the key chain's
        X̂ `[B, 1, T, d]`: p `[B, H, g, NC, C]` -> `[B, H, g, D]`, summed in the latent before R (or W) maps it."""
        if self.config.source == "keys":
            z = ctx.inputs["keys"]
        else:
            z = (torch.cat([state["outliers"], y], -1) if self.config.outliers else y).flatten(2, 3)
        rows = p.flatten(1, 2).flatten(-2)  # [B, H·g, T]: every head's rows read the one latent row per token
        o = (rows @ z[:, 0].float()).unflatten(1, p.shape[1:3])
        return self.map_output(o, rows.sum(-1, keepdim=True).unflatten(1, p.shape[1:3]), ctx)


def _rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x², -1) + eps) · scale` in float32: x `[..., F]`, scale `[F]`."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale.float()


def key_outlier_channels(w_k: torch.Tensor, topk: int = 1) -> torch.Tensor:
    """Key channels predicted to carry the outliers, from the weight alone (App. B): `K = Σ_j σ_j (X·u_j)·b_jᵀ` is
    dominated by its j = 0 term, so the `topk` largest |entries| of b_0 (first row of Bᵀ, `w_k: [d, H·D]`)."""
    _, r = weight_factors(w_k)  # R = Σ·Bᵀ: row 0 is σ_0·b_0ᵀ
    return r[0].abs().topk(topk).indices


def _check(bits: int, attention: str, first_layers: int, first_bits: int) -> None:
    if attention not in ATTENTION:
        raise ValueError(f"xquant attention={attention!r}; allowed: {ATTENTION}")
    if first_layers < 0:
        raise ValueError(f"xquant first_layers={first_layers} must be >= 0")
    for name, value in (("bits", bits), ("first_bits", first_bits)):
        if value not in range(1, 9):
            raise ValueError(f"xquant {name}={value}: 1 to 8 bits")


def _plain(bits: int, attention: str, group: int, token_group: int, outliers: int = 0) -> tuple[list, list]:
    """XQuant's (keys, values) transforms: GQA latents (keys per channel, values per token), or MHA's X per token."""
    if attention == "mha":
        return ([T.rotate("pre_rope"), T.project("weights", side="k", basis="input"),
                 T.quantize(bits=bits, axis="token", group=token_group), T.pack()],
                [T.project("weights", side="v", basis="input", source="keys")])
    return ([T.rotate("pre_rope"), T.project("weights", side="k", outliers=outliers),
             T.quantize(bits=bits, axis="channel", group=group), T.pack()],
            [T.project("weights", side="v"), T.quantize(bits=bits, axis="token", group=token_group), T.pack()])


def _x_cache(bits: int, token_group: int, delta: list | None = None) -> tuple[list, list]:
    """(keys, values) transforms caching X (or, after `delta`, its delta) per token; values read the keys' X̂."""
    return ([T.rotate("pre_rope"), T.project("weights", side="k", basis="input"), *(delta or []),
             T.quantize(bits=bits, axis="token", group=token_group), T.pack()],
            [T.project("weights", side="v", basis="input", source="keys")])


def xquant(
    bits: int, attention: str = "auto", first_layers: int = 0, first_bits: int = 4, outliers: int = 0,
    group: int = 128, token_group: int = 64, residual: int = 128,
) -> KVPipeline:
    """XQuant at `bits`: the first `first_layers` layers at `first_bits` (Table 4 uses 3 at 4 bits);
    `group` tokens per per-channel range, `token_group` channels per per-token range (the paper's 128 does
    not divide SmolLM2's widths 192 and 576); `outliers` float16 key latent channels (GQA, App. B)."""
    _check(bits, attention, first_layers, first_bits)
    if outliers and attention == "mha":
        raise ValueError("xquant outliers= applies to the GQA latents; MHA caches X itself")
    form = "gqa" if attention == "auto" else attention
    keys, values = _plain(bits, form, group, token_group, outliers)
    return KVPipeline(keys, values, residual=residual, chunk=group,
                      layers=dict.fromkeys(range(first_layers), _plain(first_bits, form, group, token_group, outliers)))


def xquant_cl(
    bits: int, attention: str = "auto", first_layers: int = 3, first_bits: int = 4, token_group: int = 64,
    group: int = 128, residual: int = 128,
) -> KVPipeline:
    """XQuant-CL at `bits`: layers before the base are XQuant at `first_bits`, the base (layer
    `first_layers − 1`) caches X at `first_bits`, the others the error-feedback delta against the previous
    layer's X̂ (GQA: projected onto the span of `[W_k | W_v]`), per token."""
    _check(bits, attention, first_layers, first_bits)
    if first_layers < 1:
        raise ValueError("xquant_cl first_layers must be >= 1: the last of them is the cross-layer base")
    form = "gqa" if attention == "auto" else attention
    before_base = [_plain(first_bits, form, group, token_group) for _ in range(first_layers - 1)]
    delta = [T.predict("delta", subspace=form == "gqa")]
    keys, values = _x_cache(bits, token_group, delta)
    return KVPipeline(keys, values, residual=residual, chunk=group,
                      layers=dict(enumerate([*before_base, _x_cache(first_bits, token_group)])))


def attention_form(config) -> dict[str, str]:
    """MHA when the keys and values together are twice as wide as X (X is then worth caching), else GQA."""
    head_dim = config_head_dim(config)
    return {"attention": "mha" if config.num_key_value_heads * head_dim == config.hidden_size else "gqa"}


for _bits in (4, 3, 2):
    register_preset(
        f"xquant-{_bits}bit", nominal_bits=float(_bits), for_model=attention_form,
        description=f"XQuant {_bits}-bit: cache the layer input X (GQA: its K/V weight-SVD latents), rematerialize K/V",
    )(functools.partial(xquant, _bits))
for _bits in (3, 2):
    register_preset(
        f"xquant-cl-{_bits}bit", nominal_bits=float(_bits), for_model=attention_form,
        description=f"XQuant-CL {_bits}-bit: cross-layer deltas of X with error feedback, 3 first layers at 4 bits",
    )(functools.partial(xquant_cl, _bits))
