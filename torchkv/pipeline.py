"""KVPipeline: a key chain and a value chain of transforms, plus the cache's window settings."""

import ast
import dataclasses
import json
import math
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchkv import registry
from torchkv import window as windows
from torchkv._compat import mark_dynamic, own_cache, recompile_headroom
from torchkv.ops import PLANAR_BITS, triton_decode
from torchkv.transforms import Context, ProjectionWeights, Transform, build

CONFIG_FILE = "torchkv_config.json"
PARAMS_FILE = "torchkv_params.safetensors"
FORMAT_VERSION = 1
DEFAULT_PRESET = "kivi-4bit"
#: compiled code rounds through the stored metadata dtypes exactly as eager does
COMPILE_OPTIONS = {"emulate_precision_casts": True, "cpp_wrapper": True}
#: `compile="auto"`: eager calls of a function before it is compiled (layers that share chains share the count).
#: A count, not a time, so that whether a step runs compiled (which rounds differently) never depends on the machine's
#: speed. 2,048 calls are about 5 s of eager decode attention on 2 CPU cores at 1K-4K tokens (1.3-4 ms a call), about
#: what compiling one function costs with Inductor's disk cache warm: a process stops paying the eager price once it
#: has paid as much as compiling would cost (ski rental); a 30-layer model's first 68 steps never wait for a compile.
EAGER_CALLS_BEFORE_COMPILE = 2048
#: inputs a predict transform reads: the previous layer's reconstruction of the same tokens ("previous") and,
#: in the value chain, this layer's reconstructed keys ("keys"), both in the chain's carried space (`Chain.carry_index`)
CROSS_INPUTS = frozenset({"previous", "keys"})


def parse_preset(text: str) -> tuple[str, dict[str, Any]]:
    """`name[:key=value...]` -> (preset name, overrides), e.g. "kivi-2bit:residual=32:group=64". Values are Python
    literals (numbers, booleans, tuples, quoted strings), or else taken as strings. The one spelling of a preset
    with overrides: `torchkv.patch`, `KVPipeline.from_preset`, `torchkv eval`/`generate` and the benchmarks."""
    name, *options = text.split(":")
    overrides: dict[str, Any] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"preset option {option!r} in {text!r} must be written key=value, e.g. kivi-2bit:residual=32")
        if key in overrides:
            raise ValueError(f"preset option {key!r} is given twice in {text!r}")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value
    return name, overrides


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _sub(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Entries of `state` under `prefix`, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _prefixed(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in state.items()}


def _decode_pair(keys: "Chain", values: "Chain", state, head_dim: int, params, prepared, inputs):
    """Keys and values `[B, H, T, head_dim]` from a pipeline's encoded state ("k."/"v." entries)."""
    k = keys.decode(_sub(state, "k."), head_dim, _sub(params, "k."), _sub(prepared, "k."), inputs)
    v = values.decode(_sub(state, "v."), head_dim, _sub(params, "v."), _sub(prepared, "v."), inputs)
    return k, v


def _side_inputs(inputs: Mapping[str, torch.Tensor], side: str, keys: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """One chain's inputs in a cross-layer pipeline: "previous" is the previous layer's reconstruction of this
    side (`inputs["previous.k"]` / `["previous.v"]`), "keys" this layer's reconstructed keys (value chain)."""
    own = {n: t for n, t in inputs.items() if not n.startswith("previous.")}
    if f"previous.{side}" in inputs:
        own["previous"] = inputs[f"previous.{side}"]
    if keys is not None:
        own["keys"] = keys
    return own


def _chain_spec(chain: "Chain") -> str:
    return json.dumps([t.spec() for t in chain.transforms], sort_keys=True)


def _shared_chains(
    layers: Mapping[int, tuple[list[Transform], list[Transform]]], keys: "Chain", values: "Chain"
) -> dict[int, tuple["Chain", "Chain"]]:
    """Chains by layer, one pair per distinct spec; a layer whose chains are the main ones' is left out. The
    transforms of layers that share a pair are the first such layer's, which take the others' fitted parameters
    (`Transform.params` is keyed by layer)."""
    shared = {(_chain_spec(keys), _chain_spec(values)): (keys, values)}
    out: dict[int, tuple[Chain, Chain]] = {}
    for layer in sorted(layers):
        if not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layers must be keyed by layer index (an integer >= 0), got {layer!r}")
        pair = tuple(Chain(transforms) for transforms in layers[layer])
        owner = shared.setdefault(tuple(map(_chain_spec, pair)), pair)
        for chain, own in zip(owner, pair):
            for target, t in zip(chain.transforms, own.transforms):
                if target is not t:
                    target.params.update(t.params)
        if owner[0] is not keys:
            out[layer] = owner
    return out


class Chain:
    """Transforms applied in order to keys (or values); decode runs them in reverse.

    The encoded state holds each transform's state under `"{i}."` and the last output under `"out"`.
    """

    def __init__(self, transforms: list[Transform]):
        resolved: list[Transform] = []
        for t in transforms:
            if not isinstance(t, Transform):
                raise TypeError(f"a chain takes Transform objects, got {type(t).__name__}: {t!r}")
            if t.kind == "pack" and getattr(t.config, "bits", 0) is None:
                source = next((p for p in reversed(resolved) if hasattr(p, "code_bits")), None)
                if source is None:
                    raise ValueError(f"{t!r} needs a quantizer before it in the chain, or an explicit bits=")
                t = type(t)(**{**dataclasses.asdict(t.config), "bits": source.code_bits})
            missing = t.reads_upstream - frozenset().union(*(p.prepares for p in resolved))
            if missing:
                raise ValueError(
                    f"{t!r} reads {sorted(missing)} prepared by a transform before it in the chain, and none of "
                    f"{resolved} prepares it"
                )
            resolved.append(t)
        self.transforms = resolved
        packed = len(resolved) > 1 and resolved[-1].kind == "pack" and getattr(resolved[-1], "planar", False)
        #: the transform whose `scores`/`weighted_sum` read the stored output: the last one, or the one before a
        #: planar pack when it reads packed codes
        self.reader = len(resolved) - 1 - packed
        #: why decode attention cannot score ("scores") or sum ("sums") the stored form; None where it can
        self.rebuilds = {use: self._why_rebuilt(use, packed) for use in ("scores", "sums")}
        #: decode attention scores queries against the stored form (linear transforms before the reader)
        self.scores_stored = self.rebuilds["scores"] is None
        #: decode attention sums the stored form (transforms before the reader map sums back)
        self.sums_stored = self.rebuilds["sums"] is None
        #: index of the first transform after the position-dependent ones (those reading "cos"/"sin") and the
        #: rematerializing ones: its decoded input is the chain's carried reconstruction, what a cross-layer
        #: predictor of the next layer reads: pre-RoPE keys (AQUA-KV), or the cached layer input X̂ (XQuant)
        self.carry_index = max(
            [i + 1 for i, t in enumerate(resolved) if {"cos", "sin"} & t.requires or t.rematerializes] or [0]
        )

    def _why_rebuilt(self, use: str, packed: bool) -> str | None:
        if not self.transforms:
            return "the chain is empty"
        reader = self.transforms[self.reader]
        if reader.kind == "pack" and len(self.transforms) > 1:
            return f"{reader!r} is not a planar layout (one width among {PLANAR_BITS}), which decode reductions read"
        if getattr(reader, "reads_packed", False) != packed:
            if packed:
                return f"{reader!r} has no reduction over packed codes"
            return (f"{reader!r} reads codes in the planar layout, and they are not packed to one of its widths "
                    f"{PLANAR_BITS} by a pack after it")
        method, prefix = ("scores", "weighted_sum")[use == "sums"], self.transforms[: self.reader]
        if not hasattr(reader, method):
            return f"{reader!r} has no {method} over its stored form"
        for t in prefix:
            if not (t.linear if use == "scores" else t.maps_output):
                return (f"{t!r} is not an affine map of the features shared by every token (it depends on each "
                        "token's position or on another layer), so the query cannot be mapped through it"
                        if use == "scores" else f"{t!r} does not map weighted sums of its output back")
        return None

    @property
    def token_multiple(self) -> int:
        return math.lcm(1, *(t.token_multiple for t in self.transforms))

    @property
    def needs_prepare(self) -> bool:
        return any(t.needs_prepare for t in self.transforms)

    @property
    def requires(self) -> frozenset[str]:
        return frozenset().union(*(t.requires for t in self.transforms))

    @property
    def predicts(self) -> bool:
        """Some transform reads another layer's or the other chain's reconstruction (see `KVPipeline.carries`)."""
        return bool(CROSS_INPUTS & self.requires)

    def _ctx(self, i: int, dim: int, params: Mapping, prepared: Mapping, valid=None, inputs=None) -> Context:
        upstream = {k: v for j in range(i) for k, v in _sub(prepared, f"{j}.").items()}
        return Context(dim, _sub(params, f"{i}."), _sub(prepared, f"{i}."), valid, inputs or {}, upstream)

    def scores(
        self, q: torch.Tensor, state: Mapping[str, torch.Tensor], dim: int, params: Mapping, prepared: Mapping
    ) -> torch.Tensor:
        """Scores of `q: [B, H, g, dim]` against the encoded tokens (state viewed by chunk): [B, H, g, NC, C]
        (requires `scores_stored`)."""
        q, offset = self.mapped_query(q, dim, params, prepared)
        scores = self.transforms[self.reader].scores(q, state["out"], _sub(state, f"{self.reader}."))
        return scores if offset is None else scores + offset[..., None]  # offset [B, H, g, 1, 1]

    def mapped_query(
        self, q: torch.Tensor, dim: int, params: Mapping, prepared: Mapping
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`q: [B, H, g, dim]` carried through the transforms before the reader: `(q', offset)` with
        `q·x = q'·y + offset` for y the reader's input; offset `[B, H, g, 1]` or None (requires `scores_stored`)."""
        dims, total = self.dims(dim), None
        for i, t in enumerate(self.transforms[: self.reader]):
            ctx = self._ctx(i, dims[i], params, prepared)
            offset = t.score_offset(q, ctx)
            total = offset if total is None else total if offset is None else total + offset
            q = t.map_query(q, ctx)
        return q, total

    def weighted_sum(
        self, p: torch.Tensor, state: Mapping[str, torch.Tensor], dim: int, params: Mapping, prepared: Mapping,
        inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`Σ_t p_t x̂_t` over the encoded tokens for `p: [B, H, g, NC, C]`: [B, H, g, dim] float32 (requires
        `sums_stored`)."""
        r, dims = self.reader, self.dims(dim)
        ctx = self._ctx(r, dims[r], params, prepared, None, inputs)
        out = self.transforms[r].weighted_sum(p, state["out"], _sub(state, f"{r}."), ctx)
        total = p.sum((-2, -1))[..., None]
        for i in reversed(range(r)):
            out = self.transforms[i].map_output(out, total, self._ctx(i, dims[i], params, prepared, None, inputs))
        return out

    def dims(self, dim: int) -> list[int]:
        """Input feature size of every transform for a chain input of size `dim`."""
        sizes = []
        for t in self.transforms:
            sizes.append(dim)
            dim = t.out_dim(dim)
        return sizes

    def prepare(
        self, x: torch.Tensor, params: Mapping, valid: torch.Tensor | None, inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Per-sequence state of every transform that prepares, from the prompt's tensors `x: [B, H, T, F]`."""
        last = max((i for i, t in enumerate(self.transforms) if t.needs_prepare), default=-1)
        prepared: dict[str, torch.Tensor] = {}
        for i, (t, dim) in enumerate(zip(self.transforms[: last + 1], self.dims(x.shape[-1]))):
            ctx = self._ctx(i, dim, params, prepared, valid, inputs)
            own = t.prepare(x, ctx)
            prepared.update(_prefixed(own, f"{i}."))
            if i < last:
                x, _ = t.encode(x, dataclasses.replace(ctx, prepared=own))
        return prepared

    def encode(
        self,
        x: torch.Tensor,
        params: Mapping[str, torch.Tensor],
        prepared: Mapping[str, torch.Tensor],
        valid: torch.Tensor | None,
        inputs: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """`x: [B, H, T, F]` -> encoded state (tensors with batch at dim 0, tokens at dim 2)."""
        state: dict[str, torch.Tensor] = {}
        for i, (t, dim) in enumerate(zip(self.transforms, self.dims(x.shape[-1]))):
            x, own = t.encode(x, self._ctx(i, dim, params, prepared, valid, inputs))
            state.update(_prefixed(own, f"{i}."))
        state["out"] = x
        return state

    def decode(
        self,
        state: Mapping[str, torch.Tensor],
        dim: int,
        params: Mapping[str, torch.Tensor],
        prepared: Mapping[str, torch.Tensor],
        inputs: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """Encoded state -> `[B, H, T, dim]` float32."""
        return self.decode_to(state, dim, params, prepared, inputs, 0)

    def decode_to(self, state, dim: int, params, prepared, inputs, stop: int) -> torch.Tensor:
        """Decode the transforms from the last down to `stop`: the reconstruction of transform `stop`'s input."""
        y = state["out"]
        dims = self.dims(dim)
        for i in reversed(range(stop, len(self.transforms))):
            y = self.transforms[i].decode(y, _sub(state, f"{i}."), self._ctx(i, dims[i], params, prepared, None, inputs))
        return y.float()

    def decode_below(self, y: torch.Tensor, stop: int, state, dim: int, params, prepared, inputs) -> torch.Tensor:
        """Finish a `decode_to(..., stop)`: decode transforms `stop - 1` down to 0."""
        dims = self.dims(dim)
        for i in reversed(range(stop)):
            y = self.transforms[i].decode(y, _sub(state, f"{i}."), self._ctx(i, dims[i], params, prepared, None, inputs))
        return y.float()


@dataclasses.dataclass(frozen=True)
class BitsPerValue:
    """Measured stored bits per cached value, metadata included."""

    keys: float
    values: float

    @property
    def mean(self) -> float:
        return (self.keys + self.values) / 2


class KVPipeline:
    """How a KV cache is compressed: a key chain, a value chain and the window rules.

    Args:
        keys: transforms applied to each key chunk `[B, H, T, D]`, in order.
        values: transforms applied to each value chunk.
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
            earns). Layers whose chains have the same spec share one pair of chains, and so their compiled
            graphs.
    """

    def __init__(
        self,
        keys: list[Transform],
        values: list[Transform],
        *,
        residual: int = 128,
        sinks: int = 0,
        chunk: int | None = None,
        window: windows.WindowPolicy | None = None,
        compile: bool | str = "auto",
        layers: Mapping[int, tuple[list[Transform], list[Transform]]] | None = None,
    ):
        self.keys, self.values = Chain(keys), Chain(values)
        #: the layers with chains of their own (see `layers`), by layer index
        self.layer_chains = _shared_chains(layers or {}, self.keys, self.values)
        #: each layer hands its reconstruction in projection space to the next (cross-layer prediction)
        self.carries = self.keys.predicts or self.values.predicts
        #: what `fit` calibrated the predictors for (see `check_fitted`), or None
        self.fitted_for: dict[str, Any] | None = None
        #: the model `torchkv tune` chose the per-layer chains for (see `check_fitted`), or None
        self.tuned_for: dict[str, Any] | None = None
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
        self._compiled: dict[str, Any] = {}
        self._eager_calls: dict[str, int] = {}  # `compile="auto"`: eager calls of each function
        self._row_chains: tuple[Chain, Chain] | None = None  # built by `decode_rows`
        self._layer_pipes: dict[tuple, KVPipeline] = {}  # built by `for_layer`, by chains and window rules
        self._for_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # built by `for_model`
        self._kernel_warned = False  # `attend_decode` on CUDA says once when no kernel reads the stored form

    @property
    def compile(self) -> bool | str:
        """When encoding and decode attention compile: "auto", True or False (see `KVPipeline`)."""
        return self._compile

    @compile.setter
    def compile(self, when: bool | str) -> None:
        if when not in (True, False, "auto"):
            raise ValueError(f"compile={when!r}: pass True (compile at the first call), False (never) or 'auto'")
        self._compile = when

    def _rules(self) -> tuple:
        return self.residual, self.sinks, self.chunk, self.window

    def for_layer(self, layer: int) -> "KVPipeline":
        """The pipeline that encodes `layer`: this one, or for a layer with chains of its own (`layers`) a pipeline
        of those chains with the same window rules, one per distinct pair of chains (they carry their
        reconstruction on when this pipeline predicts across layers)."""
        chains = self.layer_chains.get(layer)
        if chains is None:
            return self
        key = (id(chains[0]), *self._rules())  # a copy with other rules (simulated quantization) gets its own
        pipe = self._layer_pipes.get(key)
        if pipe is None:
            pipe = KVPipeline(chains[0].transforms, chains[1].transforms, residual=self.residual, sinks=self.sinks,
                              chunk=self.chunk, window=self.window)
            pipe.carries = self.carries
            self._layer_pipes[key] = pipe
        pipe.name, pipe.options, pipe.compile = self.name, self.options, self.compile
        return pipe

    def layer_groups(self, num_layers: int) -> list[tuple[list[int], Chain, Chain]]:
        """`(layers, keys, values)` for each distinct pair of chains among a model's `num_layers` layers."""
        groups: dict[int, tuple[list[int], Chain, Chain]] = {}
        for layer in range(num_layers):
            keys, values = self.layer_chains.get(layer, (self.keys, self.values))
            groups.setdefault(id(keys), ([], keys, values))[0].append(layer)
        return list(groups.values())

    # -- presets -------------------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str, *, compile: bool | str = "auto", **overrides: Any) -> "KVPipeline":
        """The preset `name` (see `torchkv.presets()`), with overrides of its options after colons in `name`
        (`parse_preset`: "kivi-2bit:residual=32") and as keywords.

        `compile` as in `KVPipeline`; False also reads no packed codes in decode attention (rebuilt history)."""
        import torchkv.methods  # noqa: F401  (fills the preset registry)

        name, written = parse_preset(name)
        twice = sorted(set(written) & set(overrides))
        if twice:
            raise ValueError(f"preset '{name}' option(s) {twice} given both after a colon and as keywords")
        overrides = {**written, **overrides}
        preset = registry.preset(name)
        options = preset.options()
        unknown = sorted(set(overrides) - set(options))
        if unknown:
            raise ValueError(f"preset '{name}' has no option(s) {unknown}; valid options: {sorted(options)}")
        pipe = preset.build(**overrides)
        pipe.name, pipe.options, pipe.compile = name, {**options, **overrides}, compile
        return pipe

    # -- encode / decode -----------------------------------------------------------------------------

    @property
    def needs_prepare(self) -> bool:
        return self.keys.needs_prepare or self.values.needs_prepare

    @property
    def requires(self) -> frozenset[str]:
        """Model-side inputs the transforms read (see `Transform.requires`)."""
        return self.keys.requires | self.values.requires

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
        inputs, params = inputs or {}, self.layer_params(layer)
        return {
            **_prefixed(self.keys.prepare(k, _sub(params, "k."), valid, inputs), "k."),
            **_prefixed(self.values.prepare(v, _sub(params, "v."), valid, inputs), "v."),
        }

    # The compiled functions take per-layer tensors, never the layer index, so that one graph serves all layers.

    def _encode(self, k, v, params, prepared, valid, inputs):
        if not self.carries:
            return {
                **_prefixed(self.keys.encode(k, _sub(params, "k."), _sub(prepared, "k."), valid, inputs), "k."),
                **_prefixed(self.values.encode(v, _sub(params, "v."), _sub(prepared, "v."), valid, inputs), "v."),
            }
        # closed loop: each chain's reconstruction is what the value chain and the next layer read
        state, carry = {}, {}
        for side, chain, x in (("k", self.keys, k), ("v", self.values, v)):
            own = _side_inputs(inputs, side, carry.get("k"))
            p, q = _sub(params, f"{side}."), _sub(prepared, f"{side}.")
            encoded = chain.encode(x, p, q, valid, own)
            carry[side] = chain.decode_to(encoded, x.shape[-1], p, q, own, chain.carry_index)
            state.update(_prefixed(encoded, f"{side}."))
        return {**state, **_prefixed(carry, "carry.")}

    def _decode_side(self, side: str, chain: Chain, state, head_dim: int, params, prepared, inputs, carry: dict):
        """One chain's `[B, H, T, head_dim]` from its flat encoded state; in a cross-layer pipeline it reads the
        previous layer's reconstruction (and, values, `carry["k"]`) and records its own in `carry[side]`."""
        s, p, q = _sub(state, f"{side}."), _sub(params, f"{side}."), _sub(prepared, f"{side}.")
        if not self.carries:
            return chain.decode(s, head_dim, p, q, inputs)
        own = _side_inputs(inputs, side, carry.get("k"))
        carry[side] = chain.decode_to(s, head_dim, p, q, own, chain.carry_index)
        return chain.decode_below(carry[side], chain.carry_index, s, head_dim, p, q, own)

    def _decode(self, state, head_dim, params, prepared, inputs):
        carry = {}
        k = self._decode_side("k", self.keys, state, head_dim, params, prepared, inputs, carry)
        v = self._decode_side("v", self.values, state, head_dim, params, prepared, inputs, carry)
        return (k, v, carry) if self.carries else (k, v)

    def _run(self, name: str, *args):
        fn = getattr(self, name)
        if not self.compile or torch.compiler.is_compiling():  # inside a whole-step graph: traced into it
            return fn(*args)
        calls = self._eager_calls.get(name, 0)
        if self.compile == "auto" and name not in self._compiled and calls < EAGER_CALLS_BEFORE_COMPILE:
            self._eager_calls[name] = calls + 1
            return fn(*args)
        if name not in self._compiled:
            # static shapes except the axes callers mark dynamic: automatic dynamic would also generalize
            # axes that differ between pipelines (code widths), which stops Inductor vectorizing
            self._compiled[name] = torch.compile(own_cache(fn), fullgraph=True, dynamic=False, options=COMPILE_OPTIONS)
        with recompile_headroom():
            return self._compiled[name](*args)

    @property
    def fused(self) -> bool:
        """Compiled decode attention reads both chains' stored forms: no key or value of the history is rebuilt."""
        return self.compile and self.keys.scores_stored and self.values.sums_stored and not self.carries

    def explain(self, num_layers: int | None = None) -> str:
        """How compiled decode attention reads each layer's history, one line per group of layers read alike:
        keys scored and values summed from the stored form, or rebuilt every step (and why)."""
        def reading(pipe: "KVPipeline") -> str:
            parts = []
            sides = (("keys", pipe.keys, "scores", "scored"), ("values", pipe.values, "sums", "summed"))
            for side, chain, use, verb in sides:
                why = chain.rebuilds[use]
                if not self.compile:
                    why = "compile=False runs decode attention eagerly over rebuilt tokens"
                elif self.selector is not None:
                    why = "sparse attention gathers the chunks it selects and rebuilds them"
                elif self.carries and side == "keys" and why is None:
                    why = "the pipeline predicts across layers, and the next layer reads this one's rebuilt keys"
                parts.append(f"{side} {verb} from the stored form" if why is None else f"{side} rebuilt: {why}")
            refusal = pipe.kernel_refusal()
            parts.append("on CUDA the Triton kernel over KIVI's layout" if refusal is None
                         else f"on CUDA no GPU kernel ({refusal}), Inductor's reductions")
            return "; ".join(parts)

        last = num_layers or max(self.layer_chains, default=-1) + 2
        lines: list[tuple[int, int | None, str]] = []
        for layer in range(last):
            text = reading(self.for_layer(layer))
            if lines and lines[-1][2] == text:
                lines[-1] = (lines[-1][0], layer, text)
            else:
                lines.append((layer, layer, text))
        if num_layers is None:
            lines[-1] = (lines[-1][0], None, lines[-1][2])  # the main chains serve every later layer
        if len(lines) == 1:
            return f"every layer: {lines[0][2]}"
        return "\n".join(f"layer {a}: {t}" if a == b else f"layers {a}-{'' if b is None else b}: {t}"
                         for a, b, t in lines)

    def kernel_refusal(self, head_dim: int = 128) -> str | None:
        """Why decode attention on a GPU cannot run the Triton kernel over KIVI's stored form (`ops.triton_decode`)
        for heads of `head_dim`, and runs the Inductor path instead; None when it runs the kernel."""
        from torchkv.transforms.quantizers import UniformQuantize

        if triton_decode.triton is None:
            return "Triton is not installed"
        if not self.compile:
            return "compile=False runs decode attention eagerly over rebuilt tokens"
        if self.carries or self.selector is not None:
            return "the pipeline predicts across layers or selects chunks"
        if not (self.keys.scores_stored and self.values.sums_stored):
            return "decode attention rebuilds its keys or values"
        k, v = self.keys.transforms[self.keys.reader], self.values.transforms[self.values.reader]
        for side, t, axis in (("keys", k, "channel"), ("values", v, "token")):
            uniform = isinstance(t, UniformQuantize)
            if not uniform or t.config.axis != axis or t.config.symmetric:
                stored = f"{t.kind}.{t.name}" + (
                    f"(axis={t.config.axis!r}, symmetric={t.config.symmetric})" if uniform else "")
                return (f"the kernel reads asymmetric uniform codes per {axis} as {side} (KIVI's layout), and the "
                        f"{side} are stored by {stored}")
        if self.values.reader or self.keys.dims(head_dim)[self.keys.reader] != head_dim:
            return "a transform before the value quantizer, or one that changes the key size, is not in the kernel"
        return None

    def _attend_decode(self, q, encoded, k_fp, v_fp, mask, softcap, params, prepared, inputs, live=None):
        b, hq, _, d = q.shape
        h = k_fp.shape[1]
        if triton_decode.runs_on(q.device) and self.kernel_refusal(d) is None:
            return self._kernel_decode(q, encoded, k_fp, v_fp, mask, softcap, params, prepared, live)
        qg = q.reshape(b, h, hq // h, d).float()  # [B, H, g, D], the softmax scale already applied
        flat = {n: t.flatten(2, 3) for n, t in encoded.items()}
        carry: dict[str, torch.Tensor] = {}
        # run eagerly (compile="auto" before it compiles), a chain whose stored form is one dequantization away from
        # the tokens is faster rebuilt for two matmuls than reduced over op by op (at 4K tokens, best of 5: kivi-2bit
        # 3.5 ms against 4.0 per layer, squat-2bit 2.2 against 3.5); a chain with transforms before its reader
        # (rotations) keeps mapping the query instead
        compiling = torch.compiler.is_compiling()
        if self.keys.scores_stored and not self.carries and (compiling or self.keys.reader > 0):
            s_enc = self.keys.scores(qg, _sub(encoded, "k."), d, _sub(params, "k."), _sub(prepared, "k."))
        else:  # keys rebuilt: run eagerly, rematerialized (RoPE at each position) or predicted across layers
            k_enc = self._decode_side("k", self.keys, flat, d, params, prepared, inputs, carry)  # [B, H, T, D]
            s_enc = (qg @ k_enc.transpose(-1, -2)).unflatten(-1, (encoded["k.out"].shape[2], -1))
        nc, c = s_enc.shape[-2:]
        scores = torch.cat([s_enc.flatten(-2), qg @ k_fp.float().transpose(-1, -2)], -1)  # [B, H, g, N]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        p = torch.softmax(scores, -1)
        p_enc = p[..., : nc * c].unflatten(-1, (nc, c))  # [B, H, g, NC, C]
        if self.values.sums_stored and (compiling or self.values.reader > 0):
            own = _side_inputs(inputs, "v", carry.get("k")) if self.carries else inputs
            pv, qv = _sub(params, "v."), _sub(prepared, "v.")
            out = self.values.weighted_sum(p_enc, _sub(encoded, "v."), d, pv, qv, own)
            if self.carries:
                carry["v"] = self.values.decode_to(_sub(flat, "v."), d, pv, qv, own, self.values.carry_index)
        else:
            v_enc = self._decode_side("v", self.values, flat, d, params, prepared, inputs, carry)
            out = p_enc.flatten(-2) @ v_enc
        p_fp = p[..., nc * c :]  # [B, H, g, F]
        out = out + p_fp @ v_fp.float()
        return out.reshape(b, hq, 1, d), p_fp.mean((0, 1, 2)), carry

    def _kernel_decode(self, q, encoded, k_fp, v_fp, mask, softcap, params, prepared, live):
        """`_attend_decode` as one call of the Triton kernel over the KIVI-coded chunks (`kernel_refusal` is None)."""
        b, hq, _, d = q.shape
        h = k_fp.shape[1]
        q_fp = q.reshape(b, h, hq // h, d).float()
        q_enc, offset = self.keys.mapped_query(q_fp, d, _sub(params, "k."), _sub(prepared, "k."))
        bias = None if offset is None else offset.expand(b, h, hq // h, 1).reshape(b, hq)
        codes = {n: t.flatten(2, 3) for n, t in encoded.items()}  # [B, H, NC·rows per chunk, ...]
        kr, vr = self.keys.reader, self.values.reader
        out, lse, s_fp = triton_decode.kivi_decode(
            q_enc.reshape(b, hq, d).contiguous(), q_fp.reshape(b, hq, d), codes["k.out"], codes[f"k.{kr}.scale"],
            codes[f"k.{kr}.zero"], codes["v.out"], codes[f"v.{vr}.scale"], codes[f"v.{vr}.zero"], k_fp, v_fp,
            None if mask is None else mask.reshape(mask.shape[0], -1), bias, live, softcap or 0.0,
            self.keys.transforms[kr].config.bits, self.values.transforms[vr].config.bits,
        )
        fp_attention = torch.exp(s_fp - lse[..., None]).mean((0, 1))  # [F]
        return out.reshape(b, hq, 1, d), fp_attention, {}

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
        """One compiled decode step of attention over encoded chunks and full-precision tokens.

        Keys are scored from their stored form where the key chain allows it (`Chain.scores_stored`), else
        rebuilt first (pre-RoPE keys, XQuant's rematerialization, cross-layer prediction); values are summed
        in their stored form where the value chain allows it (`Chain.sums_stored`: packed codes, XQuant's
        latents), else rebuilt. `fused` pipelines rebuild neither.

        Args:
            q: [B, Hq, 1, D]. encoded: state tensors viewed by chunk, `[B, *, NC, rows per chunk, ...]`.
            k_fp, v_fp: [B, H, F, D], the full-precision tokens, which come after the encoded ones.
            mask: [B or 1, 1, 1, NC·C + F] bool (True = attend), or None.
            params: the layer's fitted parameters (`layer_params(layer)`), to skip looking them up.
            inputs: what rebuilding the encoded tokens reads (`decode_chunk`'s inputs for them).
            live: 0-d tensor, the encoded tokens held (fixed-capacity buffers hold more slots); the GPU kernel
                reads no slot past it. None: every encoded token is held.

        Returns:
            out: [B, Hq, 1, D], q's dtype.
            fp_attention: [F] float32, each full-precision token's attention probability averaged over
                batch rows and query heads (what a window policy reads).
            carry: for pipelines that `carries`, this layer's reconstruction of the encoded tokens as
                `decode_chunk` returns it (the next layer's "previous"); else empty.
        """
        k_fp, v_fp = k_fp.contiguous(), v_fp.contiguous()  # a window's view or a fresh tensor: one graph for both
        for t in (*encoded.values(), k_fp, v_fp):
            mark_dynamic(t, 2)  # one graph for every number of chunks and window size
        for t in (inputs or {}).values():
            mark_dynamic(t, 2 if t.dim() == 4 else 1)
        if mask is not None:
            mark_dynamic(mask, 3)
        if q.is_cuda and not self._kernel_warned and not torch.compiler.is_compiling():
            refusal = self.kernel_refusal(q.shape[-1])
            if refusal is not None:
                warnings.warn(f"pipeline '{self.name}': decode attention has no GPU kernel for its stored form "
                              f"({refusal}); it runs Inductor's reductions over the stored form, which are slower",
                              stacklevel=2)
            self._kernel_warned = True
        # a Python float argument would become a fresh tensor input at every call
        scaled = q.float() * scale
        out, fp_attention, carry = self._run(
            "_attend_decode", scaled, dict(encoded), k_fp, v_fp, mask, softcap,
            self.layer_params(layer) if params is None else dict(params), dict(prepared or {}), dict(inputs or {}),
            live,
        )
        return out.to(q.dtype), fp_attention, carry

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
        if k.shape[2] % self.chunk:
            raise ValueError(f"encode_chunk got {k.shape[2]} tokens; it takes a multiple of chunk={self.chunk}")
        k, v = k.contiguous(), v.contiguous()  # a prompt's transposed projection or a window's view: one graph
        for t in (k, v, valid, *(inputs or {}).values()):
            if t is not None:
                mark_dynamic(t, 2 if t.dim() == 4 else 1)  # any number of chunks
        if "x" in self.requires and "x" not in (inputs or {}):
            raise ValueError(f"pipeline '{self.name}' caches a function of the layer input: pass inputs['x'], "
                             "[batch, tokens, hidden], the attention block's input for these tokens")
        if self.needs_prepare and not prepared:
            raise ValueError(
                f"pipeline '{self.name}' encodes with per-sequence state from the prompt: call "
                "prepared = pipe.prepare(k, v, inputs=...) on the prompt first and pass prepared=prepared"
            )
        params = self.layer_params(layer) if params is None else dict(params)
        return self._run("_encode", k, v, params, dict(prepared or {}), valid, dict(inputs or {}))

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
        for t in (*state.values(), *(inputs or {}).values()):
            mark_dynamic(t, 2 if t.dim() == 4 else 1)  # any number of tokens
        params = self.layer_params(layer) if params is None else dict(params)
        return self._run("_decode", dict(state), head_dim, params, dict(prepared or {}), dict(inputs or {}))

    @property
    def selector(self) -> Transform | None:
        """The key transform that picks the encoded tokens each attention step reads (sparse attention)."""
        return next((t for t in self.keys.transforms if hasattr(t, "select")), None)

    def decode_rows(
        self,
        state: Mapping[str, torch.Tensor],
        head_dim: int,
        prepared: Mapping[str, torch.Tensor],
        inputs: Mapping[str, torch.Tensor],
        params: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_chunk` of encoded rows gathered from anywhere in the history (eager), their token-grouped
        metadata expanded to one row per token: token-grouped transforms decode with groups of 1."""
        if self._row_chains is None:
            self._row_chains = tuple(
                Chain([type(t)(**{**dataclasses.asdict(t.config), "group": 1}) if t.token_multiple > 1 else t
                       for t in chain.transforms])
                for chain in (self.keys, self.values)
            )
        return _decode_pair(*self._row_chains, state, head_dim, params, prepared, inputs)

    # -- accounting ----------------------------------------------------------------------------------

    def bits_per_value(self, kv_heads: int = 1, head_dim: int = 64, seed: int = 0, layers: int = 1) -> BitsPerValue:
        """Stored bits per value of one encoded chunk of Gaussian data, measured on the real state tensors and
        averaged over a model's first `layers` layers (each encoded by its own chains, `layers`); with `layers=1`
        and per-layer chains, those of the main chains."""
        if layers == 1 and self.layer_chains:
            main = next(i for i in range(len(self.layer_chains) + 1) if i not in self.layer_chains)
            return self._bits(kv_heads, head_dim, seed, main)
        measured: dict[int, BitsPerValue] = {}
        per_layer = []
        for i in range(layers):
            pipe = self.for_layer(i)
            if id(pipe) not in measured:
                measured[id(pipe)] = pipe._bits(kv_heads, head_dim, seed, i)
            per_layer.append(measured[id(pipe)])
        return BitsPerValue(sum(b.keys for b in per_layer) / layers, sum(b.values for b in per_layer) / layers)

    def _bits(self, kv_heads: int, head_dim: int, seed: int, layer: int) -> BitsPerValue:
        gen = torch.Generator().manual_seed(seed)
        k, v = (torch.randn(1, kv_heads, self.chunk, head_dim, generator=gen) for _ in range(2))
        inputs = {}
        if {"cos", "sin"} & self.requires:  # the identity rotation: position 0 everywhere
            inputs = {"cos": torch.ones(1, self.chunk, head_dim), "sin": torch.zeros(1, self.chunk, head_dim)}
        if "queries" in self.requires:  # one query head per KV head
            inputs["queries"] = torch.randn(1, kv_heads, self.chunk, head_dim, generator=gen)
        if "x" in self.requires:  # the layer input, as wide as the fitted weights read
            widths = {t.input_width for c in (self.keys, self.values) for t in c.transforms if "x" in t.requires}
            if None in widths:
                raise ValueError(f"pipeline '{self.name}' reads the layer input through weights it has not been "
                                 "fitted to; call pipe = pipe.for_model(model) first")
            inputs["x"] = torch.randn(1, self.chunk, widths.pop(), generator=gen)
        params = self.layer_params(layer)
        device = next((t.device for t in params.values()), torch.device("cpu"))  # fitted on the model's device
        k, v = k.to(device), v.to(device)
        inputs = {n: t.to(device) for n, t in inputs.items()}
        with torch.no_grad():
            prepared = self.prepare(k, v, inputs=inputs) if self.needs_prepare else {}
            state = self._encode(k, v, params, prepared, None, inputs)  # eager: accounting only
        n = k.numel()
        return BitsPerValue(8 * _nbytes(_sub(state, "k.")) / n, 8 * _nbytes(_sub(state, "v.")) / n)

    # -- persistence ---------------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The JSON configuration `save_pretrained` writes."""
        return {
            "format": "torchkv.KVPipeline",
            "version": FORMAT_VERSION,
            "name": self.name,
            "options": self.options,
            "residual": self.residual,
            "sinks": self.sinks,
            "chunk": self.chunk,
            "window": None if self.window is None else self.window.spec(),
            "keys": [t.spec() for t in self.keys.transforms],
            "values": [t.spec() for t in self.values.transforms],
            "layers": {str(layer): {"keys": [t.spec() for t in k.transforms], "values": [t.spec() for t in v.transforms]}
                       for layer, (k, v) in self.layer_chains.items()},
            "fitted_for": self.fitted_for,
            "tuned_for": self.tuned_for,
        }

    def layer_params(self, layer: int) -> dict[str, torch.Tensor]:
        """Fitted parameters of one layer, keyed "k.{i}.{name}" / "v.{i}.{name}"."""
        out = {}
        for side, chain in (("k", self.keys), ("v", self.values)):
            for i, t in enumerate(chain.transforms):
                out.update(_prefixed(t.layer_params(layer), f"{side}.{i}."))
        return out

    def _chains(self) -> list[tuple[str, Chain]]:
        """Every chain with the prefix of its transforms' parameters in `params()`."""
        chains = [("k.", self.keys), ("v.", self.values)]
        seen = set()
        for layer, (keys, values) in self.layer_chains.items():  # a shared pair under its first layer's index
            if id(keys) not in seen:
                seen.add(id(keys))
                chains += [(f"layer{layer}.k.", keys), (f"layer{layer}.v.", values)]
        return chains

    def params(self) -> dict[str, torch.Tensor]:
        """Calibrated parameters of every transform (what `save_pretrained` writes), keyed "k.{i}.{name}" /
        "v.{i}.{name}" ("layer{n}." before those of the chains layer n is the first to have, `layers`). Parameters a transform derives
        from the model's weights are left out: `for_model` derives them again."""
        out = {}
        for prefix, chain in self._chains():
            for i, t in enumerate(chain.transforms):
                if not t.fits_weights:
                    out.update(_prefixed(t.params, f"{prefix}{i}."))
        return out

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
        projections), fitted. Cached per model and window rules; `patch` and `new_cache` call it."""
        from torchkv.models.weights import specialize

        return specialize(self, model)

    def _to_fit(self) -> list[Transform]:
        return [t for t in self.keys.transforms + self.values.transforms if t.needs_fit]

    @property
    def needs_fit(self) -> bool:
        """Some transform must be calibrated (`fit`) before the pipeline is used."""
        return bool(self._to_fit())

    def check_fitted(self, num_layers: int, fingerprint: dict[str, Any]) -> None:
        """Raise a clear error unless every transform that needs calibration is fitted, and the per-layer chains
        of a tuned pipeline were chosen, for this model.

        Args:
            num_layers: decoder layers of the model the cache is for.
            fingerprint: `torchkv.models.arch.fingerprint(model)` of that model.
        """
        if self.tuned_for is not None and self.tuned_for != fingerprint:
            raise ValueError(f"pipeline '{self.name}' was tuned for another model "
                             f"({_differences(self.tuned_for, fingerprint)}); tune it for this one: "
                             f"`torchkv tune --preset {self.name} --budget BITS --out DIR`")
        unfitted = self._to_fit()
        if not unfitted:
            return
        how = (f"calibrate it first: pipe.fit(model, texts), or `torchkv calibrate --preset {self.name} --out DIR` "
               "and load DIR")
        if self.fitted_for is None:
            raise ValueError(f"pipeline '{self.name}' has uncalibrated transforms {unfitted}; {how}")
        if self.fitted_for != fingerprint:
            raise ValueError(f"pipeline '{self.name}' was calibrated for another model "
                             f"({_differences(self.fitted_for, fingerprint)}); {how}")
        missing = [layer for layer in range(1, num_layers) for t in unfitted if not t.layer_params(layer)]
        if missing:
            raise ValueError(f"pipeline '{self.name}' has no fitted parameters for layers {sorted(set(missing))}; {how}")

    def fit(self, model, texts: list[str], **options: Any) -> dict[str, Any]:
        """Calibrate the transforms that need it on `model` over `texts` (AQUA-KV's predictors, Alg. 1);
        options and the returned report as `torchkv.models.calibrate.fit_pipeline` has them."""
        from torchkv.models.calibrate import fit_pipeline

        return fit_pipeline(self, model, texts, **options)

    def tune(self, model, texts, *, budget: float, **options: Any) -> "KVPipeline":
        """This pipeline with per-layer, per-K/V widths chosen on `model` over calibration `texts` to meet `budget`
        stored bits per value (`torchkv tune`); options as `torchkv.tuning.tune` has them."""
        from torchkv.tuning import tune

        return tune(self, model, texts, budget=budget, **options)[0]

    def save_pretrained(self, path: str | Path) -> None:
        """Write `torchkv_config.json` and, when there are fitted parameters, `torchkv_params.safetensors`. A tensor
        that several chains share (tuned layers keep the preset's fitted transforms) is written once, under its first
        name; the file's "aliases" metadata maps the other names to it."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.config(), indent=2))
        params = self.params()
        if params:
            first: dict[int, str] = {}
            aliases = {k: first.setdefault(id(v), k) for k, v in params.items()}
            aliases = {k: name for k, name in aliases.items() if name != k}
            tensors = {k: v.contiguous().cpu() for k, v in params.items() if k not in aliases}
            save_file(tensors, str(path / PARAMS_FILE), metadata={"aliases": json.dumps(aliases)})

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "KVPipeline":
        """Load what `save_pretrained` wrote."""
        from safetensors import SafetensorError, safe_open
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG_FILE).is_file():
            raise ValueError(f"{path} has no {CONFIG_FILE}; save a pipeline there with pipe.save_pretrained(path)")
        resave = "save the pipeline again with pipe.save_pretrained(path)"
        try:
            config = json.loads((path / CONFIG_FILE).read_text())
        except ValueError as err:  # invalid JSON or not UTF-8 (truncated or garbled)
            raise ValueError(f"{path / CONFIG_FILE} is not valid JSON ({err}); {resave}") from err
        if not isinstance(config, dict) or config.get("format") != "torchkv.KVPipeline":
            raise ValueError(f"{path / CONFIG_FILE} is not a torchkv pipeline config of version {FORMAT_VERSION}")
        if isinstance(config.get("version"), int) and config["version"] > FORMAT_VERSION:
            raise ValueError(f"{path / CONFIG_FILE} was written in pipeline format version {config['version']} by a "
                             f"later torchkv; this one reads version {FORMAT_VERSION}: upgrade torchkv")
        if config.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path / CONFIG_FILE} is not a torchkv pipeline config of version {FORMAT_VERSION}")
        try:
            pipe = cls.from_config(config)
        except (KeyError, TypeError, AttributeError) as err:  # a field missing or of the wrong type
            raise ValueError(f"{path / CONFIG_FILE} is incomplete or malformed ({type(err).__name__}: {err}); "
                             f"{resave}") from err
        if (path / PARAMS_FILE).is_file():
            try:  # safetensors only: nothing here unpickles
                params = load_file(str(path / PARAMS_FILE))
                with safe_open(str(path / PARAMS_FILE), "pt") as f:
                    aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
                params.update({k: params[name] for k, name in aliases.items()})
            except (SafetensorError, ValueError, KeyError) as err:  # SafetensorError is no ValueError
                raise ValueError(f"{path / PARAMS_FILE} is not a readable safetensors file of this pipeline's "
                                 f"parameters ({type(err).__name__}: {err}); {resave}") from err
            if "layers" not in config:  # saved before per-layer chains: "first{n}." held the n-th first layer's
                params = {"layer" + k[len("first"):] if k.startswith("first") else k: v for k, v in params.items()}
            pipe.load_params(params)
        return pipe

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "KVPipeline":
        """A pipeline from its `config()` (parameters not included: see `load_params`)."""
        pipe = cls(
            [build(s) for s in config["keys"]],
            [build(s) for s in config["values"]],
            residual=config["residual"],
            sinks=config["sinks"],
            chunk=config["chunk"],
            window=None if config.get("window") is None else windows.from_spec(config["window"]),
            layers={int(layer): ([build(s) for s in c["keys"]], [build(s) for s in c["values"]])
                    for layer, c in _layer_specs(config).items()},
        )
        pipe.name, pipe.options, pipe.fitted_for = config["name"], dict(config["options"]), config.get("fitted_for")
        pipe.tuned_for = config.get("tuned_for")
        return pipe

    def load_params(self, params: Mapping[str, torch.Tensor]) -> None:
        """Set the transforms' parameters from `params()`'s output."""
        for prefix, chain in self._chains():
            for i, t in enumerate(chain.transforms):
                t.params = _sub(params, f"{prefix}{i}.")

    def __repr__(self) -> str:
        def chain(c: Chain) -> str:
            return "[" + ", ".join(repr(t) for t in c.transforms) + "]"

        groups: dict[int, list[int]] = {}
        for layer, (keys, _) in self.layer_chains.items():
            groups.setdefault(id(keys), []).append(layer)
        return (
            f"KVPipeline(name={self.name!r}, residual={self.residual}, sinks={self.sinks}, chunk={self.chunk}, "
            f"window={self.window},\n"
            f"  keys={chain(self.keys)},\n  values={chain(self.values)}"
            + "".join(f",\n  layers {_ranges(layers)}: keys={chain(self.layer_chains[layers[0]][0])}, "
                      f"values={chain(self.layer_chains[layers[0]][1])}" for layers in groups.values())
            + ")"
        )


def _differences(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> str:
    """The fields two model fingerprints differ in, with both values."""
    diff = sorted(k for k in {**expected, **actual} if expected.get(k) != actual.get(k))
    return (f"differs in {diff}: expected { {k: expected.get(k) for k in diff} }, "
            f"this model { {k: actual.get(k) for k in diff} }")


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _layer_specs(config: Mapping[str, Any]) -> dict[int, dict[str, list]]:
    """The per-layer chain specs of a config; configs saved before per-layer chains held a list of the first
    layers' ("first_layers"), or one ("first_layer")."""
    if "layers" in config:
        return {int(layer): specs for layer, specs in config["layers"].items()}
    first = config.get("first_layers") or ([config["first_layer"]] if config.get("first_layer") else [])
    return dict(enumerate(first))


def _check_kv(k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor [batch, kv_heads, tokens, head_dim], got {shape}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point (float32, bfloat16 or float16), got {t.dtype}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on [batch, kv_heads, tokens]; got {tuple(k.shape)} and {tuple(v.shape)}")


def presets() -> list[dict[str, Any]]:
    """Every registered preset: name, one-line description, nominal bits per value, options, and whether it
    must be calibrated (`KVPipeline.fit`, `torchkv calibrate`) before use."""
    import torchkv.methods  # noqa: F401  (fills the preset registry)

    return [
        {
            "name": p.name,
            "description": p.description,
            "nominal_bits": p.nominal_bits,
            "options": p.options(),
            "calibrate": p.build().needs_fit,
        }
        for p in map(registry.preset, registry.preset_names())
    ]
