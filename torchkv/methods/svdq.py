"""SVDq: pre-RoPE keys in the prompt's own SVD latent channels, quantized with a per-channel-group
bit schedule (0 bits = truncated); the keys are reconstructed in the original space and RoPE is
applied at their true positions on decode.

Per layer and sequence, `project.svd` centres the prompt's pre-RoPE keys of all KV heads
concatenated (`K ∈ R^{T×d}`, d = H·D, pads excluded) and keeps the first `keep·d` right singular
vectors (§1.1); `quantize.schedule` quantizes the latent channels per channel (asymmetric, ranges
over `group` tokens, spec S8) in equal channel groups of their own widths (§1.2–1.3); `pack.bits`
packs each group at its width. Values: float16 (the paper's 16-bit values) or, in the `-v4`
presets, 4-bit per token. Tokens generated after the prompt stay in full precision (spec S7,
`generated="fp"`) or are encoded in chunks with the prompt's basis (`generated="project"`).

Sparsity (`sparse=32`, §1.6 with ShadowKV's chunk landmarks): `project.landmarks` keeps the mean of
every 8 post-RoPE prompt keys per KV head; each attention step scores the landmarks with its queries
and reads only the top 1/32 of the encoded chunks (low-coherence "outlier" chunks always among them),
gathering and reconstructing just those rows.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import torchkv.transforms as T
from torchkv.ops import SUPPORTED_BITS, dequantize, masked_pca, quantize
from torchkv.pipeline import KVPipeline
from torchkv.registry import register_preset, register_transform
from torchkv.transforms import Context, Transform, TransformConfig
from torchkv.transforms.quantizers import META_DTYPES, check_meta_dtype
from torchkv.window import PromptOnly

#: the paper's schedules (Tables 2 and 4): bits of 8 equal latent-channel groups, by decreasing singular value
SCHEDULES = {
    "3bit": (8, 4, 4, 4, 2, 2, 0, 0),
    "2.25bit": (8, 4, 4, 2, 0, 0, 0, 0),
    "2bit": (8, 4, 4, 0, 0, 0, 0, 0),
    "1.75bit": (8, 4, 2, 0, 0, 0, 0, 0),
    "1.25bit": (4, 4, 2, 0, 0, 0, 0, 0),
}
GENERATED = ("fp", "project")


@dataclass(frozen=True, kw_only=True)
class SvdConfig(TransformConfig):
    """keep: fraction of the d = H·D latent channels kept (keep·D must be an integer);
    basis_dtype: storage dtype of the kept basis columns."""

    keep: float = 1.0
    basis_dtype: str = "float16"

    def __post_init__(self):
        if not 0 < self.keep <= 1:
            raise ValueError(f"project.svd keep={self.keep!r} must be in (0, 1]")
        check_meta_dtype("project.svd", "basis_dtype", self.basis_dtype)


@register_transform("project", "svd")
class SvdProject(Transform):
    """The prompt's centred SVD basis of one layer's keys, all KV heads concatenated (SVDq §1.1, eq. 1).

    prepare: `x: [B, H, T, D]` -> "basis" `[B, H·D, r]` (r = keep·H·D right singular vectors by
    decreasing singular value), "mean" `[B, H·D]` float32 (K̄).
    encode: `x -> P = (K - K̄)·V`, laid out `[B, H, T, r/H]` with latent channel j at row j mod H,
    feature j // H, so equal groups of the features of every row are equal groups of latent channels.
    decode: `P̂·Vᵀ + K̄`, back to `[B, H, T, D]`.
    """

    Config = SvdConfig
    needs_prepare = True
    prepares = frozenset({"basis", "mean"})

    def out_dim(self, dim: int) -> int:
        kept = self.config.keep * dim
        if kept != int(kept):
            raise ValueError(f"project.svd keep={self.config.keep} times head_dim {dim} must be an integer")
        return int(kept)

    def prepare(self, x: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
        b, h, t, d = x.shape
        keys = x.transpose(1, 2).reshape(b, t, h * d)
        mean, basis, _ = masked_pca(keys, ctx.valid)
        rank = h * self.out_dim(d)
        return {"basis": basis[..., :rank].to(META_DTYPES[self.config.basis_dtype]).contiguous(), "mean": mean}

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        b, h, t, d = x.shape
        keys = x.transpose(1, 2).reshape(b, t, h * d).float()
        latent = (keys - ctx.prepared["mean"][:, None]) @ ctx.prepared["basis"].float()  # [B, T, r]
        return latent.unflatten(-1, (-1, h)).permute(0, 3, 1, 2), {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        b, h, t, _ = y.shape
        latent = y.permute(0, 2, 3, 1).reshape(b, t, -1)  # [B, T, r]
        keys = latent @ ctx.prepared["basis"].float().transpose(1, 2) + ctx.prepared["mean"][:, None]
        return keys.unflatten(-1, (h, ctx.dim)).transpose(1, 2)


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig(TransformConfig):
    """bits: width of each equal group of features (the schedule's kept groups); group: tokens per
    range (min/max) of each channel; meta_dtype: dtype of scale and zero."""

    bits: tuple[int, ...]
    group: int = 128
    meta_dtype: str = "float16"

    def __post_init__(self):
        object.__setattr__(self, "bits", tuple(self.bits))
        if not self.bits or any(b not in SUPPORTED_BITS for b in self.bits):
            raise ValueError(f"quantize.schedule bits={self.bits}: each width must be one of {SUPPORTED_BITS}")
        if self.group < 1:
            raise ValueError(f"quantize.schedule group={self.group} must be a positive integer")
        check_meta_dtype("quantize.schedule", "meta_dtype", self.meta_dtype)


@register_transform("quantize", "schedule")
class ScheduleQuantize(Transform):
    """Per-channel asymmetric min/max quantization with a width per equal group of channels (SVDq eqs. 2–3).

    encode: `x: [B, H, T, F]` -> codes `[B, H, T, F]` uint8 (group i of F/n features at `bits[i]`),
    scale/zero `[B, H, T/G, F]`. Padding tokens stay out of the ranges.
    """

    Config = ScheduleConfig

    @property
    def token_multiple(self) -> int:
        return self.config.group

    @property
    def code_bits(self) -> tuple[int, ...]:
        return self.config.bits

    def _split(self, dim: int) -> list[int]:
        n = len(self.config.bits)
        if dim % n:
            raise ValueError(f"quantize.schedule: {n} channel groups do not divide {dim} features")
        return [dim // n] * n

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        valid = None if ctx.valid is None else ctx.valid[:, None, :, None]  # [B, 1, T, 1]
        parts = [
            quantize(part, b, -2, cfg.group, False, META_DTYPES[cfg.meta_dtype], valid)
            for part, b in zip(x.split(self._split(x.shape[-1]), -1), cfg.bits)
        ]
        codes, scale, zero = (torch.cat(p, -1) for p in zip(*parts))
        return codes, {"scale": scale, "zero": zero}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        sizes = self._split(ctx.dim)
        scales, zeros = state["scale"].split(sizes, -1), state["zero"].split(sizes, -1)
        parts = zip(y.split(sizes, -1), scales, zeros, self.config.bits)
        return torch.cat([dequantize(c, s, z, b, -2, self.config.group) for c, s, z, b in parts], -1)


@dataclass(frozen=True, kw_only=True)
class LandmarksConfig(TransformConfig):
    """chunk: tokens per landmark; ratio: the sparsity ratio, encoded chunks per chunk read."""

    chunk: int = 8
    ratio: int = 32

    def __post_init__(self):
        for name in ("chunk", "ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"project.landmarks {name}={value!r} must be a positive integer")


@register_transform("project", "landmarks")
class Landmarks(Transform):
    """Chunk landmarks of the prompt's (post-RoPE) keys, for sparse attention over encoded chunks
    (SVDq §5.2 with ShadowKV's selection, spec §1.6). Leaves the keys as they are.

    prepare: `x: [B, H, T, D]` -> "landmarks" `[B, H, T/c, D]` float16 (each c-token chunk's mean key),
    "coherence" `[B, H, T/c]` float16 (the lowest cosine similarity of a chunk's keys to its mean), both over
    the chunk's real tokens (`ctx.valid`); a chunk of padding alone has coherence +inf and is never picked.
    encode/decode: the identity.
    """

    Config = LandmarksConfig
    needs_prepare = True
    selects = True
    prepares = frozenset({"landmarks", "coherence"})

    def prepare(self, x: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
        c = self.config.chunk
        whole = x.shape[2] // c * c
        chunks = x[:, :, :whole].float().unflatten(2, (-1, c))  # [B, H, NC, c, D]
        if ctx.valid is None:
            real = torch.ones(chunks.shape[:-1], dtype=torch.bool, device=x.device)
        else:
            real = ctx.valid[:, None, :whole].unflatten(2, (-1, c)).expand(chunks.shape[:-1])  # [B, H, NC, c]
        mean = (chunks * real[..., None]).sum(3) / real.sum(3, keepdim=True).clamp_min(1)
        similarity = F.cosine_similarity(chunks, mean[:, :, :, None], dim=-1)
        coherence = similarity.masked_fill(~real, math.inf).amin(-1)
        return {"landmarks": mean.half(), "coherence": coherence.half()}

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x, {}

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        return y

    def select(self, q: torch.Tensor, prepared: Mapping[str, torch.Tensor], tokens: int, scale: float) -> torch.Tensor:
        """Encoded tokens a step reads: the chunks whose landmarks score highest (softmax over chunks of
        `q·landmark·scale`, summed over the step's queries, max over each KV head's query heads), 1/ratio
        of the `tokens` encoded ones; the least coherent 3/16 of them (ShadowKV's 48 of 256) always.

        Args:
            q: [B, Hq, Q, D]. prepared: this transform's prepared state.

        Returns:
            [B, H, K·c] token indices among the encoded tokens, K = ceil(tokens / c / ratio).
        """
        c, n = self.config.chunk, tokens // self.config.chunk
        landmarks = prepared["landmarks"][:, :, :n].float()
        b, hq, nq, d = q.shape
        h = landmarks.shape[1]
        probs = torch.softmax(q.float().reshape(b, h, -1, d) @ landmarks.transpose(-1, -2) * scale, -1)
        scores = probs.view(b, h, hq // h, nq, n).sum(3).amax(2)  # [B, H, NC]
        budget = math.ceil(n / self.config.ratio)
        coherence = prepared["coherence"][:, :, :n].float()
        outliers = (-coherence).topk(math.ceil(budget * 3 / 16), -1).indices
        scores = scores.scatter(-1, outliers, math.inf).masked_fill(coherence.isinf(), -math.inf)  # padding alone
        chunks = scores.topk(budget, -1).indices.sort(-1).values  # [B, H, K]
        return (chunks[..., None] * c + torch.arange(c, device=q.device)).flatten(-2)


def svdq(
    schedule: tuple[int, ...],
    values: int = 16,
    group: int = 128,
    residual: int = 0,
    generated: str = "fp",
    sparse: int = 0,
) -> KVPipeline:
    """SVDq keys with `schedule` (bits per equal latent-channel group, truncated groups last);
    values float16 (`values=16`) or `values`-bit per token (groups of 64 channels); `sparse`: the
    sparsity ratio of attention over the encoded prompt (0: dense)."""
    schedule = tuple(schedule)
    kept = [b for b in schedule if b]
    if not kept or schedule[: len(kept)] != tuple(kept):
        raise ValueError(
            f"schedule={schedule}: give bits per latent-channel group by decreasing singular value, with the "
            f"truncated (0-bit) groups last and at least one kept, e.g. {SCHEDULES['1.25bit']}"
        )
    if generated not in GENERATED:
        raise ValueError(f"generated={generated!r}; allowed: {GENERATED} (keep generated tokens in full precision, "
                         "or encode them with the prompt's basis)")
    if values == 16:
        value_chain = [T.quantize("cast", dtype="float16")]
    elif values in SUPPORTED_BITS:
        value_chain = [T.quantize(bits=values, axis="token", group=64), T.pack()]
    else:
        raise ValueError(f"values={values!r}: 16 (float16) or a width in {SUPPORTED_BITS}")
    if sparse and generated != "fp":
        raise ValueError("sparse SVDq selects among the prompt's chunks; use generated='fp' with sparse")
    if not isinstance(sparse, int) or sparse < 0:
        raise ValueError(f"sparse={sparse!r} must be a sparsity ratio >= 1, or 0 for dense attention")
    return KVPipeline(
        keys=[
            *([T.project("landmarks", ratio=sparse)] if sparse else []),
            T.rotate("pre_rope"),
            T.project("svd", keep=len(kept) / len(schedule)),
            T.quantize("schedule", bits=tuple(kept), group=group),
            T.pack(),
        ],
        values=value_chain,
        residual=residual,
        window=PromptOnly() if generated == "fp" else None,
    )


def _register(label: str, schedule: tuple[int, ...], values: int, sparse: int) -> None:
    name = f"svdq-{label}" + ("-sparse" if sparse else "") + ("-v4" if values == 4 else "")
    v = "4-bit per-token values" if values == 4 else "float16 values"
    s = f", attention reads 1/{sparse} of the prompt's chunks" if sparse else ""
    description = f"SVDq {label}: pre-RoPE SVD latent keys, schedule {schedule}, {v}{s}"
    residual = 32 if sparse else 0  # ShadowKV's local window: 4 chunks of 8 tokens

    def build(
        schedule: tuple[int, ...] = schedule, group: int = 128, residual: int = residual, generated: str = "fp",
        sparse: int = sparse,
    ) -> KVPipeline:
        return svdq(schedule, values, group, residual, generated, sparse)

    register_preset(name, description=description, nominal_bits=(sum(schedule) / len(schedule) + values) / 2)(build)


for _label, _schedule in SCHEDULES.items():
    for _values in (16, 4):
        _register(_label, _schedule, _values, sparse=0)
_register("1.25bit", SCHEDULES["1.25bit"], 4, sparse=32)
_register("1.25bit", SCHEDULES["1.25bit"], 16, sparse=32)
