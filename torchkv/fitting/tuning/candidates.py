"""The settings a tuned layer's keys or values may take: the preset's chain with its quantizers at another width."""

import dataclasses
import itertools
import math
from collections.abc import Sequence

from torchkv.pipeline import Chain, HeadGroups, KVPipeline
from torchkv.pipeline.chain import chain_spec
from torchkv.pipeline.presets import spelling
from torchkv.transforms import Transform
from torchkv.transforms.quantizers import higgs_dim

#: widths tried for every quantizer of a chain, by side (those a quantizer refuses, or that would make decode
#: attention rebuild what the preset reads from its stored form, are left out). Keys never take 1 bit: the
#: second-order cost (`sensitivity`) underestimates it. frontier-2bit tuned to 2.5 bits on mixed text gave two
#: layers 1-bit keys, predicted to cost 0.0004 nats, and lost +7.34 / +6.52 / +5.93% at 8K (wiki / code / docs,
#: prompt mode); the same sensitivities allocated without 1-bit keys lost +0.77 / +4.42 / +3.02%
#: (benchmarks/results/domains/ablations/). 3-bit keys (6-bit codes of a 64-point 2-D grid, read from their words)
#: lowered the worst perplexity cell of the 2.5-bit tuning from +4.42% to +3.86% and of its 2.1-bit allocation from
#: +9.80% to +7.63% (three domains, prompt mode and streaming; benchmarks/results/domains/eval_*3bit_keys*). 2.5- and
#: 3.5-bit keys (5- and 7-bit codes of 32- and 128-point 2-D grids, read from their words) give the allocation half
#: steps where a layer has one KV head, so that per-head widths cannot refine it (Gemma 3: 3 full-attention layers
#: held to the budget could spend 2.36 of 2.5 bits with whole widths)
CANDIDATE_BITS = {"k": (2, 2.5, 3, 3.5, 4, 8), "v": (1, 2, 3, 4, 8)}
#: multiples of a quantizer's group tried with each width (groups share metadata: larger ones cost fewer bits)
GROUP_SCALES = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setting of one side: its transforms, a label, its measured stored bits per value, and the width and
    group multiple (`rewidth`) it was made with."""

    label: str
    transforms: tuple[Transform, ...]
    bits: float
    width: int | float
    group_scale: int


def rewidth(chain: Chain, bits: int | float, group_scale: int = 1) -> list[Transform] | None:
    """`chain`'s transforms with every quantizer at `bits` bits per value (a HIGGS grid of the largest dimension
    that has that width where the chain's own has not) and its group, where it has one, `group_scale` times as
    large; packs re-derived from them, other transforms (and their fitted parameters) kept. None when the chain
    has no quantizer with a width (or, for `group_scale` > 1, with a group), or one refuses the setting."""
    out, changed = [], False
    for t in chain.transforms:
        config = dataclasses.asdict(t.config)
        if t.kind == "quantize" and type(config.get("bits")) in (int, float):  # a width (SVDq's is a schedule)
            config["bits"], changed = bits, True
            if t.name == "higgs":
                config["dim"] = higgs_dim(bits, config["dim"])
                if config["dim"] is None:
                    return None
            if group_scale > 1:
                if not isinstance(config.get("group"), int):
                    return None
                config["group"] *= group_scale
        elif t.kind == "pack":
            config["bits"] = None
        else:
            out.append(t)
            continue
        try:
            out.append(type(t)(**config))
        except ValueError:
            return None
    return out if changed else None


def _label(transforms: list[Transform]) -> str:
    quantizers = [t for t in transforms if t.kind == "quantize" and t.code_bits is not None]
    return "+".join(f"{t.name}{t.config.bits}" + (f"x{t.config.dim}" if t.name == "higgs" else "")
                    + (f"/g{t.config.group}" if isinstance(getattr(t.config, "group", None), int) else "")
                    for t in quantizers)


def candidates(pipe: KVPipeline, kv_heads: int, head_dim: int, widths=CANDIDATE_BITS,
               group_scales=GROUP_SCALES) -> dict[str, list[Candidate]]:
    """Each side's candidate settings ("k", "v"), cheapest first, with their stored bits per value measured on
    the real state tensors of one chunk (`KVPipeline.bits_per_value`) at the model's KV shapes. Every candidate
    keeps the preset's decode reading: a chain that decode attention scores (sums) from its stored form stays so.
    A candidate whose token group exceeds the pipeline's chunk needs a larger chunk (`tuned_chunk`). `widths`: the
    widths tried, by side."""
    out = {}
    if any(isinstance(chain, HeadGroups) for chain in (pipe.keys, pipe.values)):
        raise ValueError(f"pipeline '{pipe.name}' has per-KV-head widths; tune the pipeline it was tuned from")
    for side, chain, other in (("k", pipe.keys, pipe.values), ("v", pipe.values, pipe.keys)):
        found: dict[str, Candidate] = {}
        for width, scale in itertools.product(widths[side], group_scales):
            transforms = rewidth(chain, width, scale)
            if transforms is None:
                continue
            try:
                variant = Chain(transforms)
            except ValueError:
                continue
            if any((variant.rebuilds[use] is None) != (chain.rebuilds[use] is None) for use in ("scores", "sums")):
                continue
            pair = (variant.transforms, other.transforms) if side == "k" else (other.transforms, variant.transforms)
            chunk = math.lcm(pipe.chunk, variant.token_multiple)
            trial = KVPipeline(*pair, residual=pipe.residual, sinks=pipe.sinks, chunk=chunk, compile=False)
            try:  # a dry run at the model's shapes: a group the head dimension does not divide is refused here
                bits = trial.bits_per_value(kv_heads, head_dim)
            except ValueError:
                continue
            label = _label(variant.transforms)
            found.setdefault(label, Candidate(label, tuple(variant.transforms), bits.keys if side == "k" else bits.values,
                                              width, scale))
        if not found:
            raise ValueError(f"pipeline '{pipe.name}': its {'key' if side == 'k' else 'value'} chain "
                             f"{chain.transforms} has no quantizer that takes any of the widths {widths[side]}; "
                             "tuning chooses widths per layer")
        out[side] = sorted(found.values(), key=lambda c: c.bits)
    return out


def layer_candidates(pipe: KVPipeline, layers: int, kv_heads: int, head_dim: int,
                     also: Sequence[KVPipeline] = ()) -> list[dict[str, list[Candidate]]]:
    """`candidates` of each of a model's `layers` layers, measured once per distinct layer pipeline
    (`pipe.for_layer`): a uniform preset measures its candidates once, not once per layer. With `also`, a layer's
    candidates are those of `pipe` and of each pipeline in `also` (`check_joint`), whose labels are prefixed with its
    spelling and "/" (`frontier-2bit:rotary_center=True/higgs2x4`); a chain that two offer is kept once, the first's."""
    check_joint(pipe, also)
    prefixes = ["", *(f"{spelling(other)}/" for other in also)]
    measured: dict[tuple[int, ...], dict[str, list[Candidate]]] = {}
    out = []
    for layer in range(layers):
        pipes = [p.for_layer(layer) for p in (pipe, *also)]
        key = tuple(map(id, pipes))
        if key not in measured:
            measured[key] = _joint([candidates(p, kv_heads, head_dim) for p in pipes], prefixes)
        out.append(measured[key])
    return out


def _joint(offered: list[dict[str, list[Candidate]]], prefixes: list[str]) -> dict[str, list[Candidate]]:
    """Each side's candidates of several pipelines, labels prefixed, each chain once, cheapest first."""
    if len(offered) == 1:
        return offered[0]
    out: dict[str, list[Candidate]] = {"k": [], "v": []}
    seen: set[tuple[str, str]] = set()
    for options, prefix in zip(offered, prefixes):
        for side, cands in options.items():
            for c in cands:
                chain = (side, chain_spec(Chain(list(c.transforms))))
                if chain not in seen:
                    seen.add(chain)
                    out[side].append(dataclasses.replace(c, label=prefix + c.label))
    return {side: sorted(cands, key=lambda c: c.bits) for side, cands in out.items()}


def check_joint(pipe: KVPipeline, also: Sequence[KVPipeline]) -> None:
    """Refuse pipelines whose candidates cannot be measured on the same windows as `pipe`'s: other window rules
    (residual, sinks, chunk, window: the pairs a query reads encoded differ), or cross-layer prediction (a cost
    depends on the carry of the pipeline's own chains)."""
    for other in also:
        if other.rules != pipe.rules:
            raise ValueError(f"'{spelling(other)}' keeps other exact tokens than '{spelling(pipe)}' (residual, "
                             f"sinks, chunk and window {other.rules} against {pipe.rules}): tune together presets "
                             "that differ in their key and value chains only")
        if pipe.carries or other.carries:
            raise ValueError(f"'{spelling(pipe if pipe.carries else other)}' predicts across layers, so its costs "
                             "depend on its own chains: tune it alone")


def tuned_chunk(pipe: KVPipeline, chains: list[tuple[Transform, ...]]) -> int:
    """The chunk of a pipeline made of `pipe`'s window rules and `chains`: a multiple of every chain's token group."""
    return math.lcm(pipe.chunk, *(Chain(list(c)).token_multiple for c in chains))
