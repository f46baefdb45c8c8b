"""`Chain`: the transforms applied in order to keys (or values), and how chains are shared between layers."""

import dataclasses
import json
import math
from collections.abc import Mapping

import torch

from torchkv.ops import PLANAR_BITS
from torchkv.pipeline.state import LayerState, prefixed, side_of, substate
from torchkv.transforms import Context, Transform

#: inputs a predict transform reads: the previous layer's reconstruction of the same tokens ("previous") and,
#: in the value chain, this layer's reconstructed keys ("keys"), both in the chain's carried space (`Chain.carry_index`)
CROSS_INPUTS = frozenset({"previous", "keys"})


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
                source = next((p for p in reversed(resolved) if p.code_bits is not None), None)
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
        packed = len(resolved) > 1 and resolved[-1].kind == "pack" and (resolved[-1].planar or (
            resolved[-2].reads_words and resolved[-1].bits == resolved[-2].code_bits))
        #: the transform whose `scores`/`weighted_sum` read the stored output: the last one, or the one before a
        #: planar pack (any pack of its width, where it `reads_words`) when it reads packed codes
        self.reader = len(resolved) - 1 - packed
        #: why decode attention cannot score ("scores") or sum ("sums") the stored form; None where it can
        self.rebuilds = {use: self._why_rebuilt(use, packed) for use in ("scores", "sums")}
        #: decode attention scores queries against the stored form (linear transforms before the reader)
        self.scores_stored = self.rebuilds["scores"] is None
        #: decode attention sums the stored form (transforms before the reader map sums back)
        self.sums_stored = self.rebuilds["sums"] is None
        #: the reader's scores are corrected for its codes' noise (`Transform.token_noise`)
        self.corrects_scores = bool(resolved) and resolved[self.reader].corrects_scores
        correcting = [t for i, t in enumerate(resolved) if t.corrects_scores and (i != self.reader
                                                                                  or not self.scores_stored)]
        if correcting:
            why = self.rebuilds["scores"] if correcting[0] is resolved[self.reader] else "it is not the chain's reader"
            raise ValueError(f"{correcting[0]!r} corrects the scores of its codes, which needs attention to score "
                             f"them through its stored form, and {why}: drop score_correction=True")
        #: index of the first transform after the position-dependent ones (those reading "cos"/"sin") and the
        #: rematerializing ones: its decoded input is the chain's carried reconstruction, what a cross-layer
        #: predictor of the next layer reads: pre-RoPE keys (AQUA-KV), or the cached layer input X̂ (XQuant)
        self.carry_index = max(
            [i + 1 for i, t in enumerate(resolved) if {"cos", "sin"} & t.requires or t.rematerializes] or [0]
        )

    def spec(self) -> list[dict]:
        """What `save_pretrained` writes: the transforms' specs in order."""
        return [t.spec() for t in self.transforms]

    def __repr__(self) -> str:
        return "[" + ", ".join(repr(t) for t in self.transforms) + "]"

    def _why_rebuilt(self, use: str, packed: bool) -> str | None:
        if not self.transforms:
            return "the chain is empty"
        reader = self.transforms[self.reader]
        if reader.kind == "pack" and len(self.transforms) > 1:
            return f"{reader!r} is not a planar layout (one width among {PLANAR_BITS}), which decode reductions read"
        if reader.reads_packed != packed:
            if packed:
                return f"{reader!r} has no reduction over packed codes"
            return (f"{reader!r} reads codes in the planar layout, and they are not packed to one of its widths "
                    f"{PLANAR_BITS} by a pack after it")
        method, prefix = ("scores", "weighted_sum")[use == "sums"], self.transforms[: self.reader]
        if method not in reader.reads_stored:
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

    @property
    def beyond_sequence(self) -> list:
        """What keeps this chain from being fitted per sequence on any subset of a layer's KV heads: its transforms
        fitted offline, rebuilt from the layer's input or selecting chunks, and "a predictor" where it predicts
        across layers or sides. Empty for the frontier-* and kivi-* chains."""
        held = [t for t in self.transforms if t.needs_fit or t.fits_weights or t.rematerializes or t.selects]
        return held + ["a predictor"] * self.predicts

    def _ctx(self, i: int, dim: int, own: LayerState, valid: torch.Tensor | None = None) -> Context:
        upstream = {k: v for j in range(i) for k, v in substate(own.prepared, f"{j}.").items()}
        return Context(dim, substate(own.params, f"{i}."), substate(own.prepared, f"{i}."), valid, own.inputs,
                       upstream)

    def scores(self, q: torch.Tensor, state: Mapping[str, torch.Tensor], dim: int, own: LayerState) -> torch.Tensor:
        """Scores of `q: [B, H, g, dim]` against the encoded tokens (state viewed by chunk): [B, H, g, NC, C]
        (requires `scores_stored`)."""
        q, offset = self.mapped_query(q, dim, own)
        scores = self.transforms[self.reader].scores(q, state["out"], substate(state, f"{self.reader}."))
        if offset is None:
            return scores
        return scores + offset.unflatten(-1, scores.shape[-2:] if offset.shape[-1] > 1 else (1, 1))

    def score_noise(self, q: torch.Tensor, state: Mapping[str, torch.Tensor], dim: int, own: LayerState
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where the reader corrects its scores (`Transform.token_noise`): `‖q'‖²` `[B, H, g]` of `q: [B, H, g, dim]`
        carried to the reader, and each encoded token's noise per unit of it `[B, H or 1, *token axes]` (state flat
        or viewed by chunk): the score of token t has an error of variance `‖q'‖²·noise_t`. None: no correction."""
        if not self.corrects_scores:
            return None
        r, dims = self.reader, self.dims(dim)
        noise = self.transforms[r].token_noise(substate(state, f"{r}."), state["out"].shape[1], dims[r])
        if noise is None:
            return None
        for i, t in enumerate(self.transforms[:r]):
            q = t.map_query(q, self._ctx(i, dims[i], own))
        return q.float().square().sum(-1), noise[..., 0]

    def mapped_query(self, q: torch.Tensor, dim: int, own: LayerState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`q: [B, H, g, dim]` carried through the transforms before the reader: `(q', offset)` with
        `q·x = q'·y + offset` for y the reader's input; offset `[B, H, g, 1]`, `[B, H, g, T]` where a transform's
        offset is per token, or None (requires `scores_stored`)."""
        dims, total = self.dims(dim), None
        for i, t in enumerate(self.transforms[: self.reader]):
            ctx = self._ctx(i, dims[i], own)
            offset = t.score_offset(q, ctx)
            total = offset if total is None else total if offset is None else total + offset
            q = t.map_query(q, ctx)
        return q, total

    def weighted_sum(
        self, p: torch.Tensor, state: Mapping[str, torch.Tensor], dim: int, own: LayerState
    ) -> torch.Tensor:
        """`Σ_t p_t x̂_t` over the encoded tokens for `p: [B, H, g, NC, C]`: [B, H, g, dim] float32 (requires
        `sums_stored`)."""
        r, dims = self.reader, self.dims(dim)
        out = self.transforms[r].weighted_sum(p, state["out"], substate(state, f"{r}."), self._ctx(r, dims[r], own))
        return self.map_sum(out, p.sum((-2, -1))[..., None], dim, own)

    def map_sum(self, out: torch.Tensor, total: torch.Tensor, dim: int, own: LayerState) -> torch.Tensor:
        """A weighted sum `out` [..., dim'] of the reader's inputs (weights summing to `total` [..., 1]) mapped back
        through the transforms before the reader: the weighted sum of the chain's inputs."""
        dims = self.dims(dim)
        for i in reversed(range(self.reader)):
            out = self.transforms[i].map_output(out, total, self._ctx(i, dims[i], own))
        return out

    def to_reader(self, x: torch.Tensor, dim: int, own: LayerState) -> torch.Tensor:
        """`x: [B, H, T, dim]` through the transforms before the reader: the domain that `map_sum` maps back from
        (requires `sums_stored`)."""
        dims = self.dims(dim)
        for i, t in enumerate(self.transforms[: self.reader]):
            x, _ = t.encode(x, self._ctx(i, dims[i], own))
        return x

    def dims(self, dim: int) -> list[int]:
        """Input feature size of every transform for a chain input of size `dim`."""
        sizes = []
        for t in self.transforms:
            sizes.append(dim)
            dim = t.out_dim(dim)
        return sizes

    def prepare(self, x: torch.Tensor, own: LayerState, valid: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Per-sequence state of every transform that prepares, from the prompt's tensors `x: [B, H, T, F]`
        (`own.prepared` is ignored: this builds it)."""
        last = max((i for i, t in enumerate(self.transforms) if t.needs_prepare), default=-1)
        prepared: dict[str, torch.Tensor] = {}
        for i, (t, dim) in enumerate(zip(self.transforms[: last + 1], self.dims(x.shape[-1]))):
            ctx = self._ctx(i, dim, own._replace(prepared=prepared), valid)
            mine = t.prepare(x, ctx)
            prepared.update(prefixed(mine, f"{i}."))
            if i < last:
                x, _ = t.encode(x, dataclasses.replace(ctx, prepared=mine))
        return prepared

    def encode(self, x: torch.Tensor, own: LayerState, valid: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """`x: [B, H, T, F]` -> encoded state (tensors with batch at dim 0, tokens at dim 2)."""
        state: dict[str, torch.Tensor] = {}
        for i, (t, dim) in enumerate(zip(self.transforms, self.dims(x.shape[-1]))):
            x, mine = t.encode(x, self._ctx(i, dim, own, valid))
            state.update(prefixed(mine, f"{i}."))
        state["out"] = x
        return state

    def decode(self, state: Mapping[str, torch.Tensor], dim: int, own: LayerState) -> torch.Tensor:
        """Encoded state -> `[B, H, T, dim]` float32."""
        return self.decode_to(state, dim, own, 0)

    def decode_to(self, state: Mapping[str, torch.Tensor], dim: int, own: LayerState, stop: int) -> torch.Tensor:
        """Decode the transforms from the last down to `stop`: the reconstruction of transform `stop`'s input."""
        y, dims = state["out"], self.dims(dim)
        for i in reversed(range(stop, len(self.transforms))):
            y = self.transforms[i].decode(y, substate(state, f"{i}."), self._ctx(i, dims[i], own))
        return y.float()

    def decode_below(self, y: torch.Tensor, stop: int, state, dim: int, own: LayerState) -> torch.Tensor:
        """Finish a `decode_to(..., stop)`: decode transforms `stop - 1` down to 0."""
        dims = self.dims(dim)
        for i in reversed(range(stop)):
            y = self.transforms[i].decode(y, substate(state, f"{i}."), self._ctx(i, dims[i], own))
        return y.float()

    @property
    def selector(self) -> Transform | None:
        """The transform that picks the encoded tokens each attention step reads (sparse attention), or None."""
        return next((t for t in self.transforms if t.selects), None)


def decode_pair(keys: Chain, values: Chain, state: Mapping[str, torch.Tensor], head_dim: int, layer: LayerState):
    """Keys and values `[B, H, T, head_dim]` from a pipeline's encoded state ("k."/"v." entries)."""
    k = keys.decode(substate(state, "k."), head_dim, side_of(layer, "k"))
    v = values.decode(substate(state, "v."), head_dim, side_of(layer, "v"))
    return k, v


def side_inputs(inputs: Mapping[str, torch.Tensor], side: str, keys: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """One chain's inputs in a cross-layer pipeline: "previous" is the previous layer's reconstruction of this
    side (`inputs["previous.k"]` / `["previous.v"]`), "keys" this layer's reconstructed keys (value chain)."""
    own = {n: t for n, t in inputs.items() if not n.startswith("previous.")}
    if f"previous.{side}" in inputs:
        own["previous"] = inputs[f"previous.{side}"]
    if keys is not None:
        own["keys"] = keys
    return own


def as_chain(side) -> "Chain":
    """A side given as its transforms, as a `Chain`; one already built (a `Chain`, `HeadGroups`: what decode attention
    reads of it is known) as is."""
    return side if hasattr(side, "rebuilds") else Chain(list(side))


def chain_spec(chain) -> str:
    """A chain's (or `HeadGroups`') spec as a string: chains with equal specs encode alike and share compiled
    graphs."""
    return json.dumps(chain.spec(), sort_keys=True)


def shared_chains(layers: Mapping[int, tuple], keys: Chain, values: Chain) -> dict[int, tuple]:
    """Chains by layer, one pair per distinct spec; a layer whose chains are the main ones' is left out. A side is
    given as its list of transforms, or built (a `Chain`, or `HeadGroups` of chains by KV head). The transforms of
    layers that share a pair are the first such layer's, which take the others' fitted parameters
    (`Transform.params` is keyed by layer)."""
    shared = {(chain_spec(keys), chain_spec(values)): (keys, values)}
    out: dict[int, tuple[Chain, Chain]] = {}
    for layer in sorted(layers):
        if not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layers must be keyed by layer index (an integer >= 0), got {layer!r}")
        pair = tuple(as_chain(side) for side in layers[layer])
        owner = shared.setdefault(tuple(map(chain_spec, pair)), pair)
        for chain, own in zip(owner, pair):
            for target, t in zip(chain.transforms, own.transforms):
                if target is not t:
                    target.params.update(t.params)
        if owner[0] is not keys:
            out[layer] = owner
    return out
