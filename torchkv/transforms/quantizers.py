"""Quantize transforms: uniform affine (per-token / per-channel groups), HIGGS vector quantization and plain
dtype casts."""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from torchkv.ops import (
    GRIDS,
    STEPS,
    SUPPORTED_BITS,
    dequantize,
    gaussian_mse,
    hadamard,
    hadamard_block,
    higgs_dequantize,
    higgs_quantize,
    load_grid,
    quantize,
    unpack_bits,
)
from torchkv.ops.decode import (
    affine_scores,
    affine_weighted_sum,
    code_planes,
    grid_scores,
    grid_weighted_sum,
)
from torchkv.registry import register_transform
from torchkv.transforms.base import LATER_OPTION, Context, Transform, TransformConfig

AXES = ("token", "channel")
SPANS = ("head", "token")
META_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
               "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def check_meta_dtype(owner: str, option: str, value: str) -> None:
    """Raise a clear error unless `value`, option `option` of transform `owner`, names a dtype of `META_DTYPES`."""
    if value not in META_DTYPES:
        raise ValueError(f"{owner} {option}={value!r}; allowed: {sorted(META_DTYPES)}")


CAST_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def unbiased_scale(x: torch.Tensor, x_hat: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`scale` `[..., G, 1]` of the rows `x`, `x_hat` `[..., G, R]` (a code's rebuilt rows) refitted so that each row's
    rebuilt projection on itself is the row: `s' = s·‖x‖² / (x·x̂)`, in `scale`'s dtype (a row with `x·x̂ ≤ 0` keeps
    `s`).

    A nearest-point code with the MSE-optimal scale shrinks its rows (`x·x̂ ≈ ‖x̂‖² < ‖x‖²`, by about the code's
    relative MSE). Attention averages the codes' independent errors away over many tokens but keeps that shrinkage:
    values shrunk by 10% shrink the attention output by 10%, keys shrunk by 10% cool every score by 10%."""
    x, x_hat = x.float(), x_hat.float()
    dot = (x * x_hat).sum(-1, keepdim=True)
    ratio = torch.where(dot > 0, x.square().sum(-1, keepdim=True) / torch.where(dot > 0, dot, 1.0), 1.0)
    dtype = scale.dtype
    return (scale.float() * ratio).clamp(max=torch.finfo(dtype).max).to(dtype)


@dataclass(frozen=True, kw_only=True)
class UniformConfig(TransformConfig):
    """bits: code width; axis: "token" (groups of channels) or "channel" (groups of tokens);
    group: elements per group (axis="token": None takes a token's whole row of features); symmetric: no zero
    point; meta_dtype: dtype of scale/zero; step: "range" (the group's values fit its levels) or "gaussian"
    (symmetric: the MSE-optimal step for rotated groups); unbiased: (symmetric, axis="token") each group's scale
    refitted after its codes so that the group is not shrunk (`unbiased_scale`)."""

    bits: int
    axis: str = "token"
    group: int | None = 32
    symmetric: bool = False
    meta_dtype: str = "float16"
    step: str = "range"
    unbiased: bool = field(default=False, metadata={LATER_OPTION: True})

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"quantize.uniform bits={self.bits} is not supported; allowed: {SUPPORTED_BITS}")
        if self.axis not in AXES:
            raise ValueError(f"quantize.uniform axis={self.axis!r} is not supported; allowed: {AXES}")
        if (self.group is None and self.axis != "token") or (self.group is not None and self.group < 1):
            raise ValueError(f"quantize.uniform group={self.group} must be a positive integer (or None: a token's "
                             "whole row, with axis='token')")
        check_meta_dtype("quantize.uniform", "meta_dtype", self.meta_dtype)
        if self.step not in STEPS or (self.step == "gaussian" and not self.symmetric):
            raise ValueError(f"quantize.uniform step={self.step!r}; allowed: {STEPS} ('gaussian' needs symmetric=True)")
        if self.unbiased and not (self.symmetric and self.axis == "token"):
            raise ValueError("quantize.uniform unbiased=True refits each token group's scale: it needs symmetric=True "
                             "and axis='token'")


@register_transform("quantize", "uniform")
class UniformQuantize(Transform):
    """Uniform affine round-to-nearest quantization (KIVI: keys per channel, values per token).

    encode: `x: [B, H, T, F]` -> codes `[B, H, T, F]` uint8, state scale/zero
    `[B, H, T, F/G]` (axis="token") or `[B, H, T/G, F]` (axis="channel").
    Padding tokens (`ctx.valid`) stay out of per-channel statistics.
    """

    Config = UniformConfig
    reads_packed = True
    reads_stored = frozenset({"scores", "weighted_sum"})

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
        group = cfg.group or ctx.dim
        if cfg.axis == "token" and ctx.dim % group:
            raise ValueError(
                f"quantize.uniform group={cfg.group} must divide the feature size {ctx.dim} for axis='token'"
            )
        valid = None
        if cfg.axis == "channel" and ctx.valid is not None:
            valid = ctx.valid[:, None, :, None]  # [B, 1, T, 1]
        codes, scale, zero = quantize(
            x, cfg.bits, self._dim(), group, cfg.symmetric, META_DTYPES[cfg.meta_dtype], valid, cfg.step
        )
        if cfg.unbiased:  # scale [B, H, T, F/G]
            x_hat = dequantize(codes, scale, None, cfg.bits, -1, group)
            rows = (x.unflatten(-1, (-1, group)), x_hat.unflatten(-1, (-1, group)))
            scale = unbiased_scale(*rows, scale[..., None])[..., 0]
        state = {"scale": scale} if zero is None else {"scale": scale, "zero": zero}
        return codes, state

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        cfg = self.config
        return dequantize(y, state["scale"], state.get("zero"), cfg.bits, self._dim(), cfg.group or ctx.dim)

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


def _grid_bits(points: int, dim: int) -> int | float:
    """Bits per value of a grid of `points` (a power of two) in `dim` dimensions: log2(points)/dim (int if whole)."""
    bits = (points.bit_length() - 1) / dim
    return int(bits) if bits.is_integer() else bits


#: (bits per value, grid dimension) of the shipped HIGGS grids: points = 2^(bits·dim); bits whole or half (2-D grids
#: of 32 and 128 points: 2.5 and 3.5 bits)
HIGGS_SHAPES = tuple(sorted((_grid_bits(n, d), d) for d, n in GRIDS))


def higgs_dim(bits: int | float, dim: int) -> int | None:
    """`dim` where a shipped grid of that dimension has `bits` bits per value, else the largest dimension that
    has them (8 for 1 bit, 2 for 2.5, 3, 3.5 and 4 bits); None where no grid has them."""
    if (bits, dim) in HIGGS_SHAPES:
        return dim
    return max((d for b, d in HIGGS_SHAPES if b == bits), default=None)


def _second_moment(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """`x: [B, H, R, T, F]` -> `E[x xᵀ]` over rows R and valid tokens T: `[B, H, F, F]` float32."""
    b, h, r, t, f = x.shape
    rows = x.float().flatten(2, 3)  # [B, H, R·T, F]
    if valid is not None:
        rows = rows * valid[:, None, None, :].expand(b, h, r, t).reshape(b, h, r * t, 1)
    count = (t if valid is None else valid.sum(1).clamp_min(1)) * r
    return rows.transpose(-1, -2) @ rows / torch.as_tensor(count, dtype=torch.float32).reshape(-1, 1, 1, 1)


@dataclass(frozen=True, kw_only=True)
class HiggsConfig(TransformConfig):
    """bits: bits per value, whole or half (bits·d whole); dim: grid dimension d (a grid of 2^(bits·d) points);
    span: "head" (one scale per token and KV head) or "token" (one scale per token over all KV heads); scale_dtype:
    scale storage; query_metric: choose each code and scale under the second moment of the prompt's queries as a
    `project.balance` before it maps them (`higgs_quantize`'s `metric`); unbiased: each row's scale refitted after
    its codes so that the row is not shrunk (`unbiased_scale`); score_correction (keys): attention subtracts half
    each encoded token's score-noise variance from its score (`HiggsQuantize.token_noise`)."""

    bits: int | float = 2
    dim: int = 2
    span: str = "head"
    scale_dtype: str = "float16"
    query_metric: bool = field(default=False, metadata={LATER_OPTION: True})
    unbiased: bool = field(default=False, metadata={LATER_OPTION: True})
    score_correction: bool = field(default=False, metadata={LATER_OPTION: True})

    def __post_init__(self):
        if (self.bits, self.dim) not in HIGGS_SHAPES:
            allowed = ", ".join(f"(bits={b}, dim={d})" for b, d in HIGGS_SHAPES)
            raise ValueError(f"quantize.higgs bits={self.bits}, dim={self.dim} has no shipped grid; allowed: {allowed}")
        if self.span not in SPANS:
            raise ValueError(f"quantize.higgs span={self.span!r} is not supported; allowed: {SPANS}")
        check_meta_dtype("quantize.higgs", "scale_dtype", self.scale_dtype)
        if self.unbiased and self.query_metric:
            raise ValueError("quantize.higgs takes unbiased=True or query_metric=True, not both: each refits the scale")


@register_transform("quantize", "higgs")
class HiggsQuantize(Transform):
    """HIGGS: Hadamard rotation, L2 scale per row, nearest point of a Gaussian-MSE grid (spec aquakv.md §4.2).

    encode: `x: [B, H, T, F]` -> codes `[B, H, T, F/d]` uint8, state scale `[B, H, T, 1]` (span="head") or
    `[B, 1, T, 1]` (span="token": the H·F features of a token form one row, Hadamard blocks stay within a
    head). Data-free: no calibration; relative MSE ≈ the grid's Gaussian MSE for non-adversarial rows.

    Decode attention reads the packed codes (`x̂ = H(ĉ)·s/√F`, H symmetric orthogonal):
    `q·x̂ = (s/√F)·(qH)·ĉ` with the query rotated once per step, and `Σ_t p_t x̂_t = H(Σ_t p_t (s_t/√F) ĉ_t)`
    rotated back once.
    """

    Config = HiggsConfig
    reads_packed = True
    reads_words = True  # `_stored` unpacks each token's codes (2-D grids of 32, 64, 128 points: 5-, 6-, 7-bit codes)
    reads_stored = frozenset({"scores", "weighted_sum"})

    def __init__(self, **config):
        super().__init__(**config)
        cfg = self.config
        self.grid = load_grid(1 << self.code_bits, cfg.dim)  # [n, d] float32
        #: with `score_correction`, the grid's mean squared error per coordinate on Gaussian rows (`gaussian_mse`)
        self.mse = gaussian_mse(1 << self.code_bits, cfg.dim) if cfg.score_correction else None
        if cfg.query_metric:  # the metric is prepared once per sequence from the prompt's queries
            self.needs_prepare, self.requires = True, frozenset({"queries"})
            self.reads_upstream, self.prepares = frozenset({"balance"}), frozenset({"block_metric"})

    @property
    def code_bits(self) -> int:
        return round(self.config.bits * self.config.dim)

    def out_dim(self, dim: int) -> int:
        if dim % self.config.dim:
            fits = ", ".join(f"(bits={b}, dim={d})" for b, d in HIGGS_SHAPES if dim % d == 0) or "none"
            raise ValueError(f"quantize.higgs dim={self.config.dim} must divide the feature size {dim}; the shipped "
                             f"grids whose dimension divides it: {fits}")
        return dim // self.config.dim

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        h, f = x.shape[1], x.shape[-1]
        self.out_dim(f)  # d must divide F
        block, dtype = hadamard_block(f), META_DTYPES[cfg.scale_dtype]
        metric = ctx.prepared["block_metric"] if cfg.query_metric else None  # [B, H, F/d, d, d]
        if cfg.span == "head":
            metric = None if metric is None else metric[:, :, None]
            codes, scale = self._quantize(x, block, dtype, metric)
            return codes, {"scale": scale}
        rows = x.transpose(1, 2).flatten(2)  # [B, T, H·F]
        metric = None if metric is None else metric.flatten(1, 2)[:, None]  # [B, 1, H·F/d, d, d]
        codes, scale = self._quantize(rows, block, dtype, metric)
        codes = codes.unflatten(-1, (h, f // cfg.dim)).transpose(1, 2)  # [B, T, H·F/d] -> [B, H, T, F/d]
        return codes.contiguous(), {"scale": scale[:, None]}  # [B, 1, T, 1]; contiguous like every stored chunk

    def _quantize(self, rows: torch.Tensor, block: int, dtype: torch.dtype, metric: torch.Tensor | None):
        """`higgs_quantize` of `rows` `[..., R]`, the scales refitted where `unbiased`: (codes, scale `[..., 1]`)."""
        grid = self.grid_on(rows.device)
        codes, scale = higgs_quantize(rows, grid, block, scale_dtype=dtype, metric=metric)
        if self.config.unbiased:
            scale = unbiased_scale(rows, higgs_dequantize(codes, scale, grid, block), scale)
        return codes, scale

    def prepare(self, x: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
        """With `query_metric`: "block_metric", the d×d diagonal blocks of `H M H`, M = `E[(q/w)(q/w)ᵀ]` the second
        moment of the prompt's queries (pads excluded) divided by the balance `w` before this quantizer, in the
        codes' rotated domain: `[B, H, F/d, d, d]` float32."""
        if not self.config.query_metric:
            return {}
        f, d = x.shape[-1], self.config.dim
        block = hadamard_block(f)
        moment = _second_moment(self.prompt_queries(x, ctx) / ctx.upstream["balance"][:, :, None], ctx.valid)
        rotated = hadamard(hadamard(moment, block).transpose(-1, -2), block)  # H M H, [B, H, F, F]
        blocks = rotated.unflatten(-1, (f // d, d)).unflatten(-3, (f // d, d))  # [B, H, K, d, K, d]
        return {"block_metric": torch.diagonal(blocks, dim1=2, dim2=4).permute(0, 1, 4, 2, 3).contiguous()}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        block = hadamard_block(ctx.dim)
        if self.config.span == "head":
            return higgs_dequantize(y, state["scale"], self.grid_on(y.device), block)
        h = y.shape[1]
        rows = y.transpose(1, 2).flatten(2)  # [B, T, H·F/d]
        rows = higgs_dequantize(rows, state["scale"][:, 0], self.grid_on(y.device), block)  # [B, T, H·F]
        return rows.unflatten(-1, (h, ctx.dim)).transpose(1, 2)  # [B, H, T, F]

    def grid_on(self, device: torch.device) -> torch.Tensor:
        """The grid `[n, d]` float32, kept on the device last asked for. A prompt's encoding moves it there before
        any decode graph is traced, so compiled graphs read it as a tensor of their device: a CPU tensor copied
        inside a CUDA graph would make Inductor skip CUDA graphs."""
        if self.grid.device != device:
            self.grid = self.grid.to(device)
        return self.grid

    def row_norm(self, heads: int, dim: int) -> float:
        """r = 1/√(row size) for `heads` KV heads of `dim` features: a stored row is `s·r·grid[codes]`."""
        return 1 / math.sqrt(dim if self.config.span == "head" else heads * dim)

    def rotated_query(self, q: torch.Tensor) -> torch.Tensor:
        """`q: [..., F]` in the codes' rotated domain, where `q·x̂ = s·r·(qH)·grid[codes]`."""
        return hadamard(q, hadamard_block(q.shape[-1]))

    def _stored(self, packed: torch.Tensor, state: Mapping[str, torch.Tensor], dim: int):
        """Grid indices `[B, H, NC, C, F/d]` and each row's multiplier `s·r` `[B, H or 1, NC, C, 1]`."""
        codes = unpack_bits(packed, self.code_bits, dim // self.config.dim)
        return codes, state["scale"].float() * self.row_norm(packed.shape[1], dim)

    @property
    def corrects_scores(self) -> bool:
        return self.config.score_correction

    def token_noise(self, state: Mapping[str, torch.Tensor], heads: int, dim: int) -> torch.Tensor | None:
        """With `score_correction`: each stored row's score-noise variance per unit squared query norm,
        `mse·(s·r)²` `[B, H or 1, *token axes, 1]` (float32), from its multiplier `s·r` (state flat or viewed by chunk).

        A row's code error `e = x − x̂` has about `mse·(s·r)²` per coordinate in the rotated domain, independent of
        its direction, so a query `q` scores it with an error of variance `σ² = mse·‖q‖²·(s·r)²`. Softmax weighs
        `exp(q·x̂) = exp(q·x)·exp(q·e)`, and `E[exp(q·e)] = exp(σ²/2)`: noisy rows, large ones most, take more weight
        than their exact scores give them. Attention subtracts `σ²/2` from each encoded token's score."""
        if not self.corrects_scores:
            return None
        return state["scale"].float().square() * (self.mse * self.row_norm(heads, dim) ** 2)

    def scores(self, q: torch.Tensor, packed: torch.Tensor, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Decode attention scores read from packed grid codes (planar, or in words for 5-, 6- and 7-bit codes).

        Args:
            q: [B, H, g, F] float32. packed: [B, H, NC, C, M] uint8; state viewed by chunk likewise.

        Returns:
            [B, H, g, NC, C] float32.
        """
        f = q.shape[-1]
        codes, scale = self._stored(packed, state, f)
        return grid_scores(self.rotated_query(q), codes, scale, self.grid_on(q.device))

    def weighted_sum(
        self, p: torch.Tensor, packed: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context
    ) -> torch.Tensor:
        """`Σ_t p_t x̂_t` read from packed grid codes: p [B, H, g, NC, C] -> [B, H, g, F] float32."""
        codes, scale = self._stored(packed, state, ctx.dim)
        return hadamard(grid_weighted_sum(p, codes, scale, self.grid_on(p.device)), hadamard_block(ctx.dim))


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
    reads_stored = frozenset({"scores", "weighted_sum"})

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x.to(CAST_DTYPES[self.config.dtype]), {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        return y.float()

    # written as reductions over the stored tensor, so the compiled graph widens each element as it reads it

    def scores(self, q: torch.Tensor, y: torch.Tensor, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """`q: [B, H, g, F]` against stored rows `y: [B, H, NC, C, F]` -> `[B, H, g, NC, C]` float32."""
        return (q[:, :, :, None, None] * y[:, :, None].float()).sum(-1)

    def weighted_sum(
        self, p: torch.Tensor, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context
    ) -> torch.Tensor:
        """`Σ_t p_t y_t`: p `[B, H, g, NC, C]`, y `[B, H, NC, C, F]` -> `[B, H, g, F]` float32."""
        return (p[..., None] * y[:, :, None].float()).sum((3, 4))
