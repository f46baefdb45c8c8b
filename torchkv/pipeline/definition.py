"""`KVPipeline`: a key chain and a value chain of transforms, plus the cache's window rules; what a layer's cache does
with its tokens. Encoding and decode attention run in its `Codec`; persistence is `pipeline.io`; presets are
`pipeline.presets`; fitting to a model is `torchkv.fit`/`torchkv.tune`, which `fit`/`tune` delegate to."""

import math
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchkv import registry
from torchkv import window as windows
from torchkv.pipeline import bits, describe, fitted, io, presets
from torchkv.pipeline.bits import BitsPerValue
from torchkv.pipeline.chain import Chain, as_chain, shared_chains
from torchkv.pipeline.codec import Codec
from torchkv.pipeline.grouped_codec import GroupedCodec
from torchkv.pipeline.head_groups import HeadGroups, paired
from torchkv.pipeline.state import LayerState, prefixed, side_of
from torchkv.transforms import ProjectionWeights, Transform


class KVPipeline:
    """How a KV cache is compressed: a key chain, a value chain and the window rules.

    Args:
        keys: transforms applied to each key chunk `[B, H, T, D]`, in order (or a built `Chain` or `HeadGroups`).
        values: transforms applied to each value chunk (the same).
        residual: most recent tokens kept in full precision (KIVI's residual window).
        sinks: first tokens of the sequence kept in full precision.
        chunk: tokens encoded together; a multiple of every transform's token group.
            Default: the smallest such multiple.
        window: a window policy (`torchkv.window`): `DynamicWindow` lets the newest query's attention
            decide whether a full window (`residual + chunk` tokens) flushes or grows; `PromptOnly`
            keeps every token after the prompt in full precision. None: a full window always flushes.
        compile: run encoding and decode attention through `torch.compile(fullgraph=True)`; decode
            attention then reads packed codes directly when both chains allow it (`fused`). "auto" runs each of
            those functions eagerly for its first `EAGER_CALLS_BEFORE_COMPILE` calls in this process, then
            compiles it; True compiles at the first call; False never compiles.
        layers: `{layer: (keys, values)}`, the transforms of particular layers instead of `keys`/`values`
            (AQUA-KV stores layer 0, which has no previous layer to predict from, at a higher width; XQuant-CL
            keeps its first layers at 4 bits; `torchkv tune` gives every layer the widths its sensitivity
            earns), or a side's `HeadGroups`: its KV heads in groups with chains of their own (`torchkv tune
            --per-head`). Layers whose chains have the same spec share one pair of chains, and so their compiled
            graphs.
    """

    def __init__(
        self,
        keys: list[Transform] | Chain | HeadGroups,
        values: list[Transform] | Chain | HeadGroups,
        *,
        residual: int = 128,
        sinks: int = 0,
        chunk: int | None = None,
        window: windows.WindowPolicy | None = None,
        compile: bool | str = "auto",
        layers: Mapping[int, tuple[list[Transform], list[Transform]]] | None = None,
    ):
        self.keys, self.values = paired(as_chain(keys), as_chain(values))
        #: the layers with chains of their own (see `layers`), by layer index; head groups paired (`paired`)
        layers = {layer: paired(*map(as_chain, sides)) for layer, sides in (layers or {}).items()}
        self.layer_chains = shared_chains(layers, self.keys, self.values)
        #: encode, decode and decode attention, compiled or not (`Codec.run`); per head group where the heads are
        #: grouped (`GroupedCodec`)
        self.codec = (GroupedCodec(self.keys, self.values, compile) if isinstance(self.keys, HeadGroups) else
                      Codec(self.keys, self.values, carries=self.keys.predicts or self.values.predicts, compile=compile))
        #: what `fit` calibrated the predictors for (see `check_fitted`), or None
        self.fitted_for: dict[str, Any] | None = None
        #: the model `torchkv tune` chose the per-layer chains for (see `check_fitted`), or None
        self.tuned_for: dict[str, Any] | None = None
        #: the text domains (`torchkv.corpora.DOMAINS`, or a caller's label) `fit` and `tune` saw, or None
        self.fitted_on: str | None = None
        self.tuned_on: str | None = None
        for arg, value in (("residual", residual), ("sinks", sinks)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{arg}={value!r} must be a non-negative integer")
        multiple = math.lcm(self.keys.token_multiple, self.values.token_multiple)
        chunk = multiple if chunk is None else chunk
        if not isinstance(chunk, int) or chunk < 1 or chunk % multiple:
            raise ValueError(
                f"chunk={chunk!r} must be a positive multiple of {multiple}, the token group of the transforms"
            )
        if window is not None and window.max_window is not None and window.max_window < residual + chunk:
            raise ValueError(
                f"max_window={window.max_window} is below the window's starting size residual + chunk = "
                f"{residual + chunk}; raise max_window or lower residual/chunk"
            )
        self.residual, self.sinks, self.chunk, self.window, self.compile = residual, sinks, chunk, window, compile
        self.name = "custom"
        self.options: dict[str, Any] = {}
        self._layer_pipes: dict[tuple, KVPipeline] = {}  # built by `for_layer`, by chains and window rules
        #: pipelines `for_model` derived from this one, by model, then by window rules and `compile`
        self.specialized: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def compile(self) -> bool | str:
        """When encoding and decode attention compile: "auto", True or False (see `KVPipeline`)."""
        return self.codec.compile

    @compile.setter
    def compile(self, when: bool | str) -> None:
        if when not in (True, False, "auto"):
            raise ValueError(f"compile={when!r}: pass True (compile at the first call), False (never) or 'auto'")
        self.codec.compile = when

    @property
    def carries(self) -> bool:
        """Each layer hands its reconstruction in projection space to the next (cross-layer prediction); the
        pipelines of a model's layers with chains of their own carry when the model's does (`for_layer`)."""
        return self.codec.carries

    @carries.setter
    def carries(self, carries: bool) -> None:
        self.codec.carries = carries

    @property
    def rules(self) -> tuple:
        """The window rules: `(residual, sinks, chunk, window)`."""
        return self.residual, self.sinks, self.chunk, self.window

    def for_layer(self, layer: int) -> "KVPipeline":
        """The pipeline that encodes `layer`: this one, or for a layer with chains of its own (`layers`) a pipeline
        of those chains with the same window rules, one per distinct pair of chains (they carry their
        reconstruction on when this pipeline predicts across layers). It takes this pipeline's name, options and
        `compile` when it is made; one made under other rules or another `compile` is another pipeline."""
        chains = self.layer_chains.get(layer)
        if chains is None:
            return self
        key = (id(chains[0]), *self.rules, self.compile, self.name)
        pipe = self._layer_pipes.get(key)
        if pipe is None:
            pipe = KVPipeline(*chains, residual=self.residual, sinks=self.sinks,
                              chunk=self.chunk, window=self.window, compile=self.compile)
            pipe.carries, pipe.name, pipe.options = self.carries, self.name, self.options
            self._layer_pipes[key] = pipe
        return pipe

    # -- presets -------------------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str, *, compile: bool | str = "auto", **overrides: Any) -> "KVPipeline":
        """The preset `name` (see `torchkv.presets()`), with overrides of its options after colons in `name`
        (`parse_preset`: "kivi-2bit:residual=32") and as keywords.

        `compile` as in `KVPipeline`; False also reads no packed codes in decode attention (rebuilt history)."""
        return presets.from_preset(name, compile=compile, **overrides)

    # -- encode / decode -----------------------------------------------------------------------------

    @property
    def needs_prepare(self) -> bool:
        return self.keys.needs_prepare or self.values.needs_prepare

    @property
    def requires(self) -> frozenset[str]:
        """Model-side inputs this pipeline's own chains read (see `Transform.requires`)."""
        return self.keys.requires | self.values.requires

    @property
    def layers_require(self) -> frozenset[str]:
        """Model-side inputs the chains of any layer read (`requires`, and those of the layers with chains of their
        own): what a model patched with this pipeline gives the layers that read them."""
        return self.requires.union(*(chain.requires for pair in self.layer_chains.values() for chain in pair))

    def prepare(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layer: int = 0,
        valid: torch.Tensor | None = None,
        inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-sequence state from the prompt's keys and values `[B, H, T, D]` (SVDq basis, SQuat subspace)."""
        state = LayerState(self.layer_params(layer), {}, dict(inputs or {}))
        return {**prefixed(self.keys.prepare(k, side_of(state, "k"), valid), "k."),
                **prefixed(self.values.prepare(v, side_of(state, "v"), valid), "v.")}

    def _check_heads(self, heads: int) -> None:
        """Refuse, before any compiled encoding, a layer whose KV heads the head groups do not cover
        (`HeadGroups.prepare` and `encode` check again, eagerly where called alone)."""
        for chain in (self.keys, self.values):
            if isinstance(chain, HeadGroups):
                chain.check_heads(heads)

    @property
    def fused(self) -> bool:
        """Compiled decode attention reads both chains' stored forms: no key or value of the history is rebuilt."""
        return self.compile and self.keys.scores_stored and self.values.sums_stored and not self.carries

    def explain(self, num_layers: int | None = None) -> str:
        """How compiled decode attention reads each layer's history, one line per group of layers read alike:
        keys scored and values summed from the stored form, or rebuilt every step (and why)."""
        return describe.explain(self, num_layers)

    def kernel_refusal(self, head_dim: int = 128) -> str | None:
        """Why decode attention on a GPU runs no Triton kernel over the stored form (`Codec.kernel`) for heads of
        `head_dim`, and runs the Inductor path instead; None when it runs one."""
        return self.codec.kernel_refusal(head_dim)

    def attend_decode(
        self,
        q: torch.Tensor,
        encoded: Mapping[str, torch.Tensor],
        k_fp: torch.Tensor,
        v_fp: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float | None = None,
        layer: int = 0,
        prepared: Mapping[str, torch.Tensor] | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
        inputs: Mapping[str, torch.Tensor] | None = None,
        live: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """One compiled decode step of attention over encoded chunks and full-precision tokens of `layer`
        (`params`: its fitted parameters, to skip looking them up); arguments and returns as
        `Codec.attend_decode`."""
        if q.is_cuda:
            self.codec.warn_without_kernel(self.name, q.shape[-1])
        params = self.layer_params(layer) if params is None else params
        return self.codec.attend_decode(q, encoded, k_fp, v_fp, mask, scale, softcap, params, prepared, inputs, live)

    def encode_chunk(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layer: int = 0,
        prepared: Mapping[str, torch.Tensor] | None = None,
        valid: torch.Tensor | None = None,
        inputs: Mapping[str, torch.Tensor] | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Encode keys and values `[B, H, T, D]` (T a multiple of `chunk`) into one flat state dict.

        `valid: [B, T]` marks real tokens (False at padding). Keys' entries start with "k.", values' with "v.".
        `params` are the layer's fitted parameters (default: looked up for `layer`).
        Pipelines that `carries` read the previous layer's reconstruction of these tokens from
        `inputs["previous.k"]`/`["previous.v"]` and also return this layer's, `"carry.k"`/`"carry.v"`
        `[B, H, T, D]` float32 in projection space: the next layer's "previous" (not state to store).
        """
        _check_kv(k, v)
        self._check_heads(k.shape[1])
        if k.shape[2] % self.chunk:
            raise ValueError(f"encode_chunk got {k.shape[2]} tokens; it takes a multiple of chunk={self.chunk}")
        if "x" in self.requires and "x" not in (inputs or {}):
            raise ValueError(f"pipeline '{self.name}' caches a function of the layer input: pass inputs['x'], "
                             "[batch, tokens, hidden], the attention block's input for these tokens")
        if self.needs_prepare and not prepared:
            raise ValueError(
                f"pipeline '{self.name}' encodes with per-sequence state from the prompt: call "
                "prepared = pipe.prepare(k, v, inputs=...) on the prompt first and pass prepared=prepared"
            )
        params = self.layer_params(layer) if params is None else params
        return self.codec.encode_chunk(k, v, params, prepared, valid, inputs)

    def decode_chunk(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        head_dim: int,
        layer: int = 0,
        prepared: Mapping[str, torch.Tensor] | None = None,
        inputs: Mapping[str, torch.Tensor] | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of `encode_chunk`: `(k, v)`, each `[B, H, T, head_dim]` float32; pipelines that `carries`
        return `(k, v, carry)` with `carry` {"k", "v"} as `encode_chunk` describes."""
        params = self.layer_params(layer) if params is None else params
        return self.codec.decode_chunk(state, head_dim, params, prepared, inputs)

    def history_noise(
        self,
        q: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        head_dim: int,
        prepared: Mapping[str, torch.Tensor] | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
        layer: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where the key chain corrects its scores for its codes' noise (`score_correction`): for queries `q`
        `[B, Hq, Q, head_dim]` and the flat encoded state of `encode_chunk`, (`‖q'‖²` `[B, Hq, Q]`, each encoded
        token's noise `[B, H, T]`, float32): attention over the rebuilt tokens subtracts `½·s²·‖q'‖²·noise_t` from
        the score of query i and token t at softmax scale s. None: no correction."""
        params = self.layer_params(layer) if params is None else params
        return self.codec.history_noise(q, state, head_dim, LayerState(params, prepared or {}, {}))

    @property
    def selector(self) -> Transform | None:
        """The key transform that picks the encoded tokens each attention step reads (sparse attention)."""
        return self.keys.selector

    # -- accounting ----------------------------------------------------------------------------------

    def bits_per_value(self, kv_heads: int = 1, head_dim: int = 64, seed: int = 0, layers: int | list[int] = 1
                       ) -> BitsPerValue:
        """Stored bits per value of one encoded chunk of Gaussian data, measured on the real state tensors and
        averaged over a model's first `layers` layers, or the layers listed (`pipeline.bits.bits_per_value`)."""
        return bits.bits_per_value(self, kv_heads, head_dim, seed, layers)

    # -- persistence ---------------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The JSON configuration `save_pretrained` writes (`pipeline.io.config`)."""
        return io.config(self)

    def layer_params(self, layer: int) -> dict[str, torch.Tensor]:
        """Fitted parameters of one layer, keyed "k.{i}.{name}" / "v.{i}.{name}"."""
        out = {}
        for side, chain in (("k", self.keys), ("v", self.values)):
            for i, t in enumerate(chain.transforms):
                out.update(prefixed(t.layer_params(layer), f"{side}.{i}."))
        return out

    def chains(self) -> list[tuple[str, Chain]]:
        """Every chain with the prefix of its transforms' parameters in `params()`."""
        chains = [("k.", self.keys), ("v.", self.values)]
        seen = set()
        for layer, (keys, values) in self.layer_chains.items():  # a shared pair under its first layer's index
            if id(keys) not in seen:
                seen.add(id(keys))
                chains += [(f"layer{layer}.k.", keys), (f"layer{layer}.v.", values)]
        return chains

    def params(self) -> dict[str, torch.Tensor]:
        """Calibrated parameters of every transform, what `save_pretrained` writes (`pipeline.io.params`)."""
        return io.params(self)

    def borrowed_params(self) -> frozenset[str]:
        """Names in `layer_params` that are views of the model's own weights (no memory of their own)."""
        return frozenset(f"{side}.{i}.{name}" for side, chain in (("k", self.keys), ("v", self.values))
                         for i, t in enumerate(chain.transforms) for name in t.borrowed)

    def fit_weights(self, weights: list[ProjectionWeights]) -> None:
        """Fit the transforms that derive parameters from a model's projections, each layer by the chains that
        encode it (`weights[layer]`, see `torchkv.models.weights.projection_weights`)."""
        with torch.no_grad():
            for layer, w in enumerate(weights):
                layer_pipe = self.for_layer(layer)
                for t in layer_pipe.keys.transforms + layer_pipe.values.transforms:
                    if t.fits_weights:
                        t.fit_weights(layer, w)

    def for_model(self, model) -> "KVPipeline":
        """This pipeline for `model`: options its preset derives from the model's shapes when left "auto"
        (XQuant's MHA or GQA form), and the parameters transforms derive from the model's weights (XQuant's
        projections), fitted. Cached per model and window rules; `patch` and `new_cache` call it. Delegates to
        `torchkv.models.weights.specialize`."""
        return registry.delegate("for_model")(self, model)

    def to_fit(self) -> list[Transform]:
        """The transforms that need calibration (`fit`), whether fitted yet or not."""
        return [t for t in self.keys.transforms + self.values.transforms if t.needs_fit]

    @property
    def needs_fit(self) -> bool:
        """Some transform must be calibrated (`fit`) before the pipeline is used."""
        return bool(self.to_fit())

    def check_fitted(self, num_layers: int, fingerprint: dict[str, Any]) -> None:
        """Raise a clear error unless the transforms that need calibration are fitted, and a tuned pipeline's
        per-layer chains chosen, for the model of `num_layers` layers and `fingerprint` (`pipeline.fitted`)."""
        fitted.check_fitted(self, num_layers, fingerprint)

    def fit(self, model, texts: list[str], **options: Any) -> dict[str, Any]:
        """Calibrate the transforms that need it on `model` over `texts` (AQUA-KV's predictors, Alg. 1): a thin
        delegate to `torchkv.fit(pipe, model, texts, ...)`, which gives the options and the returned report."""
        return registry.delegate("fit")(self, model, texts, **options)

    def tune(self, model, texts, *, budget: float, **options: Any) -> "KVPipeline":
        """This pipeline with per-layer, per-K/V widths chosen on `model` over calibration `texts` to meet `budget`
        stored bits per value: a thin delegate to `torchkv.tune(pipe, model, texts, budget=...)[0]`."""
        return registry.delegate("tune")(self, model, texts, budget=budget, **options)[0]

    def save_pretrained(self, path: str | Path) -> None:
        """Write `torchkv_config.json` and, when there are fitted parameters, `torchkv_params.safetensors`
        (`pipeline.io.save`)."""
        io.save(self, path)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "KVPipeline":
        """Load what `save_pretrained` wrote (`pipeline.io.load`: older format versions migrate, later ones are
        refused with the version they need)."""
        return io.load(cls, path)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "KVPipeline":
        """A pipeline from its `config()` (parameters not included: see `load_params`)."""
        return io.from_config(cls, config)

    def load_params(self, params: Mapping[str, torch.Tensor]) -> None:
        """Set the transforms' parameters from `params()`'s output."""
        io.load_params(self, params)

    def __repr__(self) -> str:
        return describe.describe(self)

def _check_kv(k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor [batch, kv_heads, tokens, head_dim], got {shape}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point (float32, bfloat16 or float16), got {t.dtype}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on [batch, kv_heads, tokens]; got {tuple(k.shape)} and {tuple(v.shape)}")
