"""`HeadGroups`: one side of a layer whose KV heads are split into groups, each encoded by a chain of its own
(per-KV-head widths, `torchkv tune --per-head`), and `paired`, which puts a layer's two sides in the same groups.
`GroupedCodec` encodes and attends over them."""

import math
from collections.abc import Sequence

import torch

from torchkv.pipeline.chain import Chain, chain_spec
from torchkv.pipeline.state import LayerState, prefixed, substate
from torchkv.transforms import Transform


class HeadGroups:
    """KV heads in groups, each with its own chain: what `KVPipeline(layers=...)` takes in place of a list of
    transforms for one side of a layer.

    Args:
        groups: `[(heads, transforms), ...]`; the heads of all groups together are 0 .. H-1, each once, and the
            transforms are a chain's (fitted per sequence only: a chain fitted offline, predicting across layers
            or selecting chunks is refused).

    The encoded and prepared state hold group i's chain's state under `"g{i}."`. Every tensor keeps the batch at
    dim 0 and the tokens at dim 2, the group's heads at dim 1.
    """

    def __init__(self, groups: Sequence[tuple[Sequence[int], list[Transform] | Chain]]):
        self.heads = [tuple(int(h) for h in heads) for heads, _ in groups]
        self.chains = [c if isinstance(c, Chain) else Chain(list(c)) for _, c in groups]
        order = [h for heads in self.heads for h in heads]
        if not groups or any(not heads for heads in self.heads) or sorted(order) != list(range(len(order))):
            raise ValueError(f"head groups {self.heads} must be non-empty and hold the KV heads 0..H-1 once each")
        for chain in self.chains:
            if chain.beyond_sequence:
                raise ValueError(f"a head group's chain {chain.transforms} cannot hold {chain.beyond_sequence}: "
                                 "parameters fitted offline, predictors across layers and chunk selection span all of "
                                 "a layer's KV heads; group chains fitted per sequence only (frontier-*, kivi-*)")
        self.num_heads = len(order)
        self.token_multiple = math.lcm(*(c.token_multiple for c in self.chains))
        self.rebuilds = {use: next((f"heads {heads}: {c.rebuilds[use]}" for heads, c in zip(self.heads, self.chains)
                                    if c.rebuilds[use] is not None), None) for use in ("scores", "sums")}
        self.scores_stored = self.rebuilds["scores"] is None
        self.sums_stored = self.rebuilds["sums"] is None
        self.predicts, self.selector = False, None

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

    def _own(self, i: int, own: LayerState) -> LayerState:
        """Group i's view of `own` at the prompt: its prepared state and the prompt's query heads that read its KV
        heads."""
        inputs = dict(own.inputs)
        if "queries" in inputs:
            per = inputs["queries"].shape[1] // self.num_heads
            inputs["queries"] = inputs["queries"][:, [h * per + j for h in self.heads[i] for j in range(per)]]
        return LayerState({}, substate(own.prepared, f"g{i}."), inputs)

    def prepare(self, x: torch.Tensor, own: LayerState, valid: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Per-sequence state of every group's chain from the prompt's `x: [B, H, T, F]` (and its queries)."""
        self.check_heads(x.shape[1])
        out = {}
        for i, (heads, chain) in enumerate(zip(self.heads, self.chains)):
            if chain.needs_prepare:
                out.update(prefixed(chain.prepare(x[:, list(heads)], self._own(i, own), valid), f"g{i}."))
        return out

    def spec(self) -> dict:
        """What `save_pretrained` writes: `{"heads": [[...], ...], "chains": [[transform spec, ...], ...]}`."""
        return {"heads": [list(h) for h in self.heads], "chains": [c.spec() for c in self.chains]}

    def __repr__(self) -> str:
        return "{" + "; ".join(f"heads {list(h)}: {c!r}" for h, c in zip(self.heads, self.chains)) + "}"


def paired(keys, values) -> tuple:
    """A layer's key and value sides with their KV heads in the same groups, one group per distinct (key chain, value
    chain) pair in order of its first head, so that each group is a plain pair of chains (`GroupedCodec` runs it
    with the `Codec` every layer with that pair shares). Sides without `HeadGroups`, or whose heads all take one
    pair, come back as chains."""
    grouped = [side for side in (keys, values) if isinstance(side, HeadGroups)]
    if not grouped:
        return keys, values
    heads = grouped[0].num_heads
    for side in grouped:
        side.check_heads(heads)
    pairs: dict[tuple[str, str], tuple[Chain, Chain, list[int]]] = {}
    for h in range(heads):
        pair = tuple(_chain_of(side, h) for side in (keys, values))
        pairs.setdefault(tuple(map(chain_spec, pair)), (*pair, []))[2].append(h)
    if len(pairs) == 1:
        k, v, _ = next(iter(pairs.values()))
        return k, v
    groups = list(pairs.values())
    return HeadGroups([(h, k) for k, _, h in groups]), HeadGroups([(h, v) for _, v, h in groups])


def _chain_of(side, head: int) -> Chain:
    if not isinstance(side, HeadGroups):
        return side
    return next(c for heads, c in zip(side.heads, side.chains) if head in heads)
