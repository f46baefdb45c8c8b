"""The transform contract shared by every kind (DESIGN §3).

A transform maps a token chunk forward (`encode`) and back (`decode`). Inputs are `[B, H, T, F]`
(batch, KV heads, tokens, features); every tensor of encoded state keeps the batch at dim 0 and a
token-derived axis at dim 2 (T, or T/G for per-group metadata), so the cache stores a growing
history by concatenating along dim 2 and reorders beams along dim 0.
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class Context:
    """What a transform sees besides its input tensor.

    Attributes:
        dim: size F of the last axis of this transform's input (static per chain).
        params: this transform's fitted parameters for the current layer (see `Transform.params`).
        prepared: per-sequence state this transform returned from `prepare`.
        valid: [B, T] bool, False at padding positions (encode and prepare only).
        inputs: model-side tensors a method asked for (e.g. "queries": [B, Hq, T, D]).
        upstream: per-sequence state prepared by the transforms before this one in the chain (e.g. the
            update matrices a SQuat quantizer takes from its query-subspace projection).
    """

    dim: int
    params: Mapping[str, torch.Tensor] = field(default_factory=dict)
    prepared: Mapping[str, torch.Tensor] = field(default_factory=dict)
    valid: torch.Tensor | None = None
    inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    upstream: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ProjectionWeights:
    """One layer's key and value projections in the row-vector convention `K = X·k + k_bias` (before RoPE), and
    for models that normalize keys after their projection (Qwen3, Gemma 3, OLMo 2) that RMS norm:
    `K = rms_norm(X·k + k_bias)·k_norm`.

    Attributes:
        k, v: [d, H·D] (views of the model's weights, transposed). k_bias, v_bias: [H·D] or None.
        k_norm: the key norm's scale, [D] (per head: Qwen3, Gemma 3) or [H·D] (all heads at once: OLMo 2), or None.
        k_norm_eps: its epsilon.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    k_norm_eps: float = 0.0


#: field metadata of a transform option added after format 1 of saved folders (see `Transform.spec`)
LATER_OPTION = "later_option"


@dataclass(frozen=True, kw_only=True)
class TransformConfig:
    """Base of every transform's frozen, keyword-only configuration."""


class Transform:
    """Base class: one registered step of a key or value chain.

    Subclasses set `Config` (a frozen keyword-only dataclass) and implement `encode`/`decode`;
    `prepare` (online, from the prompt) and fitted `params` (offline) are optional.
    """

    kind: ClassVar[str]
    name: ClassVar[str]
    Config: ClassVar[type[TransformConfig]] = TransformConfig
    needs_prepare: ClassVar[bool] = False
    needs_fit: ClassVar[bool] = False
    #: tokens per chunk must be a multiple of this (e.g. a per-channel group along tokens).
    token_multiple: ClassVar[int] = 1
    #: names of `Context.inputs` this transform reads; the cache supplies them for the tokens at hand:
    #: "cos"/"sin" ([B, T, R] rotary embedding), "queries" ([B, Hq, T, D], prompt only, at prepare),
    #: "x" ([B, T, d], the layer input: the attention block's normalized hidden states).
    requires: ClassVar[frozenset[str]] = frozenset()
    #: parameters derived from the model's projection weights (`fit_weights`), not calibrated or saved
    fits_weights: ClassVar[bool] = False
    #: decode computes keys or values from what the chain caches, a function of the layer input (XQuant's
    #: rematerialization): the chain's carried reconstruction is this transform's encoded output
    rematerializes: ClassVar[bool] = False
    #: width of the layer input "x" the transform reads (set by `fit_weights`), and names of its parameters
    #: that are views of the model's own weights (not counted as cache memory)
    input_width: int | None = None
    borrowed: frozenset[str] = frozenset()
    #: names of the state `prepare` returns, and names this transform reads from `Context.upstream`
    #: (a chain checks at construction that an earlier transform prepares each of them).
    prepares: ClassVar[frozenset[str]] = frozenset()
    reads_upstream: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, **config: Any):
        fields = {f.name for f in dataclasses.fields(self.Config)}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ValueError(
                f"{self.kind}.{self.name} got unknown option(s) {unknown}; valid options: {sorted(fields)}"
            )
        self.config = self.Config(**config)
        #: fitted parameters, keyed "{layer}.{name}" (what `save_pretrained` writes)
        self.params: dict[str, torch.Tensor] = {}

    def layer_params(self, layer: int) -> dict[str, torch.Tensor]:
        """The fitted parameters of one layer, keyed by name."""
        prefix = f"{layer}."
        return {k[len(prefix) :]: v for k, v in self.params.items() if k.startswith(prefix)}

    def fit_weights(self, layer: int, weights: "ProjectionWeights") -> None:
        """Derive this layer's parameters from the model's key/value projections (`fits_weights` transforms)."""
        raise NotImplementedError(f"{self.kind}.{self.name} does not fit from weights")

    def out_dim(self, dim: int) -> int:
        """Size of the last axis of `encode`'s output for an input of size `dim`."""
        return dim

    def prepare(self, x: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
        """Per-sequence state from the prompt's own tensors (batch at dim 0). Default: none."""
        return {}

    def prompt_queries(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The prompt's queries `ctx.inputs["queries"]` `[B, Hq, T, F]` grouped by the KV head they read
        (query head i reads KV head i // (Hq/H)): `[B, H, Hq/H, T, F]`, for keys `x: [B, H, T, F]`."""
        q = ctx.inputs.get("queries")
        if q is None:
            raise ValueError(
                f"{self.kind}.{self.name} needs the prompt's queries: patch the model with torchkv.patch, or pass "
                "inputs={'queries': q} ([batch, query_heads, tokens, head_dim]) to KVPipeline.prepare"
            )
        b, h, t, f = x.shape
        if q.shape[0] != b or q.shape[2] != t or q.shape[1] % h or q.shape[3] != f:
            raise ValueError(f"queries {tuple(q.shape)} do not match keys {tuple(x.shape)} (batch, tokens, GQA heads)")
        return q.reshape(b, h, q.shape[1] // h, t, f)

    def encode(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`x: [B, H, T, F]` -> (output passed to the next transform, state to store)."""
        raise NotImplementedError

    def decode(self, y: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: Context) -> torch.Tensor:
        """Inverse of `encode`: the next transform's decoded output and this one's state -> `[B, H, T, F]`."""
        raise NotImplementedError

    # -- attention over the encoded form (decode), optional ------------------------------------------
    # A transform may also read its own stored output in decode attention: `scores(q, y, state)` ->
    # `[B, H, g, NC, C]` and `weighted_sum(p, y, state, ctx)` -> `[B, H, g, F]`, with y its output as stored
    # (the packed codes when `reads_packed`: it is then followed by a planar pack, or by any pack of its own
    # code width when `reads_words`), viewed by chunk.
    #: a linear map of the features, or an affine one whose offset is per-sequence state (`score_offset`):
    #: scores and weighted sums can be computed in the encoded space through `map_query` / `map_output`
    #: (rotations, projections, centring).
    linear: ClassVar[bool] = False
    #: `score_offset` is per token, `[B, H, g, T]` (it reads each token's position), which the GPU kernels do
    #: not take; it reads either the tokens' "cos"/"sin" or, in decode attention over whole chunks whose positions
    #: run on, the chunk tables of `SharedRope.chunk_tables`
    offset_per_token: ClassVar[bool] = False
    #: `scores`/`weighted_sum` read planar-packed codes (the chain must end with a planar pack after it)
    reads_packed: ClassVar[bool] = False
    #: they also read codes packed in words (3, 5, 6, 7 bits): the reader unpacks each token's codes before it
    #: gathers from them, where reductions over planes would need the planar layout
    reads_words: ClassVar[bool] = False
    #: which of `scores` and `weighted_sum` the transform defines over its stored output
    reads_stored: ClassVar[frozenset[str]] = frozenset()
    #: picks the encoded tokens each decode step reads (`select`: sparse attention)
    selects: ClassVar[bool] = False

    @property
    def code_bits(self) -> int | tuple[int, ...] | None:
        """The width of the integer codes the transform emits (what a `pack.bits` after it packs); None: no codes."""
        return None

    @property
    def maps_output(self) -> bool:
        """decode is affine in its input, so `map_output` carries weighted sums of encoded rows back."""
        return self.linear

    def map_query(self, q: torch.Tensor, ctx: Context) -> torch.Tensor:
        """`q': [..., F']` with `q · x = q' · encode(x)` for every x (linear transforms only)."""
        raise NotImplementedError(f"{self.kind}.{self.name} is not linear")

    def score_offset(self, q: torch.Tensor, ctx: Context) -> torch.Tensor | None:
        """`[B, H, g, 1]` (or `[B, H, g, T]` per token, `offset_per_token`) with `q · x = map_query(q) · encode(x) +
        offset` for every x; None for a linear map."""
        return None

    @property
    def corrects_scores(self) -> bool:
        """Attention corrects this reader's scores for its codes' noise (`token_noise`)."""
        return False

    def token_noise(self, state: Mapping[str, torch.Tensor], heads: int, dim: int) -> torch.Tensor | None:
        """A reader whose scores attention corrects for its codes' noise: each stored row's score-error variance per
        unit squared query norm (the query carried to the reader), `[B, H or 1, *token axes, 1]`, from its own state
        (flat or viewed by chunk) for `heads` KV heads of `dim` features; None: scores are read as they are."""
        return None

    def map_output(self, o: torch.Tensor, total: torch.Tensor, ctx: Context) -> torch.Tensor:
        """`Σ_t p_t y_t` `[B, H, g, F']` -> `Σ_t p_t decode(y_t)` `[B, H, g, F]`, with `total` `[B, H, g, 1]`
        the weights' sum Σ_t p_t (what an affine decode's offset is multiplied by)."""
        raise NotImplementedError(f"{self.kind}.{self.name} does not map weighted sums back")

    def spec(self) -> dict[str, Any]:
        """JSON-serialisable description, what `save_pretrained` writes. An option added after format 1
        (`LATER_OPTION` metadata) is written only when it differs from its default, so folders saved before it
        existed save again unchanged."""
        config = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)
                  if not (f.metadata.get(LATER_OPTION) and getattr(self.config, f.name) == f.default)}
        return {"kind": self.kind, "name": self.name, "config": config}

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self.config).items())
        return f"{self.kind}.{self.name}({options})"
