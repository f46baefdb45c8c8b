"""`HeadGroups`: one side of a layer whose KV heads are split into groups, each encoded by a chain of its own
(per-KV-head widths, `torchkv tune --per-head`). Heads never mix in attention, so each group is encoded, scored
and summed on its own heads and the results are put back in head order."""

import math
from collections.abc import Mapping, Sequence

import torch

from torchkv.pipeline.chain import Chain
from torchkv.pipeline.state import LayerState, prefixed, substate
from torchkv.transforms import Transform


class HeadGroups:
    """KV heads in groups, each with its own chain: what `KVPipeline(layers=...)` takes in place of a list of
    transforms for one side of a layer.

    Args:
        groups: `[(heads, transforms), ...]`; the heads of all groups together are 0 .. H-1, each once, and the
            transforms are a chain's (fitted per sequence only: a chain fitted offline, predicting across layers
            or selecting chunks is refused).

    The encoded state holds group i's chain's state under `"g{i}."`. Every tensor keeps the batch at dim 0 and the
    tokens at dim 2, the group's heads at dim 1.
    """

    def __init__(self, groups: Sequence[tuple[Sequence[int], list[Transform] | Chain]]):
        self.heads = [tuple(int(h) for h in heads) for heads, _ in groups]
        self.chains = [c if isinstance(c, Chain) else Chain(list(c)) for _, c in groups]
        order = [h for heads in self.heads for h in heads]
        if not groups or any(not heads for heads in self.heads) or sorted(order) != list(range(len(order))):
            raise ValueError(f"head groups {self.heads} must be non-empty and hold the KV heads 0..H-1 once each")
        for chain in self.chains:
            refused = [t for t in chain.transforms if t.needs_fit or t.fits_weights or t.rematerializes or t.selects]
            if refused or chain.predicts:
                raise ValueError(f"a head group's chain {chain.transforms} cannot hold {refused or 'a predictor'}: "
                                 "parameters fitted offline, predictors across layers and chunk selection span all of "
                                 "a layer's KV heads; group chains fitted per sequence only (frontier-*, kivi-*)")
        #: where each KV head of the layer is among the groups' heads, group after group (None: in order)
        self.inverse = None if order == sorted(order) else sorted(range(len(order)), key=order.__getitem__)
        self.num_heads = len(order)
        self.token_multiple = math.lcm(*(c.token_multiple for c in self.chains))
        self.rebuilds = {use: next((f"heads {heads}: {c.rebuilds[use]}" for heads, c in zip(self.heads, self.chains)
                                    if c.rebuilds[use] is not None), None) for use in ("scores", "sums")}
        self.scores_stored = self.rebuilds["scores"] is None
        self.sums_stored = self.rebuilds["sums"] is None
        #: decode attention maps the query through transforms before some group's reader (`Codec.attend`)
        self.reader = max(c.reader for c in self.chains)
        self.carry_index, self.predicts, self.selector = 0, False, None

    @property
    def transforms(self) -> list[Transform]:
        """Every group's transforms, group after group (what fitting, accounting and descriptions look through)."""
        return [t for c in self.chains for t in c.transforms]

    @property
    def needs_prepare(self) -> bool:
        return any(c.needs_prepare for c in self.chains)

    @property
    def requires(self) -> frozenset[str]:
        return frozenset().union(*(c.requires for c in self.chains))

    def check_heads(self, heads: int) -> None:
        """Raise a clear error unless the groups cover a layer of `heads` KV heads."""
        if heads != self.num_heads:
            raise ValueError(f"the head groups {self.heads} cover {self.num_heads} KV heads, and the layer has {heads}: "
                             "tune or build per-head widths for this model's KV heads")

    def _own(self, i: int, own: LayerState, prompt: bool = False) -> LayerState:
        """Group i's view of `own`: its prepared state and, at `prompt` (prepare), the prompt's query heads that read
        its KV heads."""
        inputs = dict(own.inputs)
        if prompt and "queries" in inputs:
            per = inputs["queries"].shape[1] // self.num_heads
            inputs["queries"] = inputs["queries"][:, [h * per + j for h in self.heads[i] for j in range(per)]]
        return LayerState({}, substate(own.prepared, f"g{i}."), inputs)

    def _merge(self, parts: list[torch.Tensor]) -> torch.Tensor:
        out = torch.cat(parts, 1)
        return out if self.inverse is None else out[:, self.inverse]

    def prepare(self, x: torch.Tensor, own: LayerState, valid: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Per-sequence state of every group's chain from the prompt's `x: [B, H, T, F]` (and its queries)."""
        self.check_heads(x.shape[1])
        out = {}
        for i, (heads, chain) in enumerate(zip(self.heads, self.chains)):
            if chain.needs_prepare:
                out.update(prefixed(chain.prepare(x[:, list(heads)], self._own(i, own, prompt=True), valid), f"g{i}."))
        return out

    def encode(self, x: torch.Tensor, own: LayerState, valid: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """`x: [B, H, T, F]` -> every group's encoded state."""
        self.check_heads(x.shape[1])
        return {k: t for i, (heads, chain) in enumerate(zip(self.heads, self.chains))
                for k, t in prefixed(chain.encode(x[:, list(heads)], self._own(i, own), valid), f"g{i}.").items()}

    def decode(self, state: Mapping[str, torch.Tensor], dim: int, own: LayerState) -> torch.Tensor:
        """Encoded state -> `[B, H, T, dim]` float32."""
        return self._merge([c.decode(substate(state, f"g{i}."), dim, self._own(i, own))
                            for i, c in enumerate(self.chains)])

    def scores(self, q: torch.Tensor, state: Mapping[str, torch.Tensor], dim: int, own: LayerState) -> torch.Tensor:
        """Scores of `q: [B, H, g, dim]` against the encoded tokens: [B, H, g, NC, C] (requires `scores_stored`)."""
        return self._merge([c.scores(q[:, list(heads)], substate(state, f"g{i}."), dim, self._own(i, own))
                            for i, (heads, c) in enumerate(zip(self.heads, self.chains))])

    def weighted_sum(self, p: torch.Tensor, state: Mapping[str, torch.Tensor], dim: int, own: LayerState
                     ) -> torch.Tensor:
        """`Σ_t p_t x̂_t` for `p: [B, H, g, NC, C]`: [B, H, g, dim] float32 (requires `sums_stored`)."""
        return self._merge([c.weighted_sum(p[:, list(heads)], substate(state, f"g{i}."), dim, self._own(i, own))
                            for i, (heads, c) in enumerate(zip(self.heads, self.chains))])

    def spec(self) -> dict:
        """What `save_pretrained` writes: `{"heads": [[...], ...], "chains": [[transform spec, ...], ...]}`."""
        return {"heads": [list(h) for h in self.heads], "chains": [c.spec() for c in self.chains]}

    def __repr__(self) -> str:
        return "{" + "; ".join(f"heads {list(h)}: {c!r}" for h, c in zip(self.heads, self.chains)) + "}"

