"""Allocate a tuned folder's measured sensitivities again at another budget, without measuring them again.

`torchkv tune` keeps every candidate's estimated KL in `tune.json`; the allocation is exact and cheap, so a budget
sweep or a candidate-set ablation needs one measurement. The candidates are today's (`CANDIDATE_BITS`) that the
source measured, optionally narrower ones left out, and the keys' costs optionally weighted (an ablation: does
the measurement price keys against values as long contexts do?). A folder tuned per KV head (`--per-head`) is
allocated per head again, from the per-head costs its `tune.json` keeps:

    python benchmarks/reallocate.py SRC_FOLDER OUT_FOLDER --budget 2.1 [--min-key-bits 2] [--min-value-bits 1]
        [--key-weight 2] [--also OTHER_FOLDER ...] [--widths-of FOLDER] [--whole-widths]

`--also` (repeatable) adds the candidates of a folder tuned from another preset on the same calibration windows
(same model, domain, tokens and window length), so that each layer, side and head takes the best of the presets'
settings at its width, e.g. keys with and without `rotary_center`, values in uniform or HIGGS codes. The costs are
measured per layer against the same full-precision gradients, so the merged allocation is the one a joint
measurement would make (`torchkv tune --also` measures so in one run); the candidates two folders share (equal
chains) must have equal costs, which checks it. A folder tuned with `--also` offers its presets' candidates too.

`--widths-of` keeps each layer's and side's width as a per-layer folder chose it and allocates among the candidates of
that width only (the presets' stored forms, and groups where a preset has them): which stored form pays at unchanged
widths (an ablation; give the folder's budget). `--whole-widths` leaves out the half-bit key widths (2.5 and 3.5 bits)
that `torchkv tune` has offered since stop 89, so that a folder tuned today can be set beside one tuned before.
"""

import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch

import torchkv
from torchkv._compat import config_head_dim
from torchkv.eval.rows import method
from torchkv.fitting.tuning import Sensitivity, bits_range, check_budget, stored_bits, tuned_for_model
from torchkv.fitting.tuning.candidates import layer_candidates
from torchkv.models.arch import full_layers
from torchkv.pipeline import Chain
from torchkv.pipeline.chain import chain_spec

#: how far the costs of one candidate measured by two folders may differ where both measured the same windows
#: (SmolLM2, two 2.5-bit folders: at most 0.6% for costs above 1e-6, 6e-7 nats absolute; other windows: up to 2x)
SAME_COST = 1e-2


def measured_on(report: dict) -> dict:
    """What a `tune.json`'s costs were measured on: model, domain, tokens, window length, and whether per KV head (a
    folder saved before "per_head" was recorded was tuned per layer)."""
    return {**{key: report.get(key) for key in ("model", "domain", "tokens", "seq_len")},
            "per_head": report.get("per_head", False)}


def reallocate(src: Path, budget: float, min_bits: dict[str, int], key_weight: float = 1.0,
               also: tuple[Path, ...] = (), widths_of: Path | None = None, whole_widths: bool = False
               ) -> tuple[torchkv.KVPipeline, dict]:
    """The tuned pipeline and report of `src`'s measured costs (and each `also` folder's, see the module docstring)
    allocated at `budget`, over candidates at least `min_bits[side]` wide (of the widths `widths_of` chose, where
    given; whole widths only with `whole_widths`), the keys' costs multiplied by `key_weight` for the choice (the
    report's costs are the measured ones)."""
    if key_weight <= 0:
        raise ValueError(f"key_weight={key_weight:g}: weight the keys' costs by a positive factor")
    report = json.loads((src / "tune.json").read_text())
    chosen = None if widths_of is None else json.loads((widths_of / "tune.json").read_text())
    if chosen is not None and chosen.get("per_head"):
        raise ValueError(f"--widths-of {widths_of} was tuned per KV head; give a folder tuned per layer")
    model, _ = torchkv.load_model(report["model"])
    per_head = measured_on(report)["per_head"]  # a folder of `torchkv tune --per-head`: its costs by KV head too
    sources = [(report, "", src)]
    for folder in also:
        other = json.loads((folder / "tune.json").read_text())
        theirs, ours = measured_on(other), measured_on(report)
        if theirs != ours:
            raise ValueError(f"{folder} was tuned on other calibration windows than {src} ("
                             + ", ".join(f"{key} {theirs[key]!r} against {ours[key]!r}" for key in ours)
                             + "): tune both on the same model, domain, --tokens and --seq-len")
        sources.append((other, f"{other['preset']}/", folder))
    config = model.config.get_text_config(decoder=True)
    layers = len(report["sensitivity"])
    pipes, besides, offered = [], [], []  # each folder's preset, the presets tuned beside it, and their candidates
    for source, _, _ in sources:
        pipe, *beside = (method(name).pipeline.for_model(model)
                         for name in (source["preset"], *source.get("also_presets", [])))
        pipes.append(pipe)
        besides.append(tuple(beside))
        offered.append(layer_candidates(pipe, layers, config.num_key_value_heads, config_head_dim(config), beside))
    kept, costs, head_costs = [], [], []
    for layer in range(layers):
        sides, layer_costs, layer_head_costs = {"k": [], "v": []}, {"k": [], "v": []}, {"k": [], "v": []}
        seen: dict[tuple[str, str], tuple[Path, float]] = {}  # each candidate chain's first folder and cost
        for (source, prefix, folder), options in zip(sources, (table[layer] for table in offered)):
            measured = source["sensitivity"][layer]
            for side in ("k", "v"):
                weight = key_weight if side == "k" else 1.0
                for c in options[side]:
                    if c.width < min_bits[side] or c.label not in measured[side]:
                        continue
                    if whole_widths and c.width != int(c.width):
                        continue
                    item, cost = (side, chain_spec(Chain(list(c.transforms)))), measured[side][c.label]
                    if item in seen:  # measured by both: the same windows give the same cost, to float noise
                        first, first_cost = seen[item]
                        if not math.isclose(cost, first_cost, rel_tol=SAME_COST, abs_tol=SAME_COST * 1e-3):
                            raise ValueError(f"layer {layer}'s {c.label} costs {cost:.6g} in {folder} and "
                                             f"{first_cost:.6g} in {first}: they were measured on other windows")
                        continue
                    seen[item] = folder, cost
                    sides[side].append(dataclasses.replace(c, label=prefix + c.label))
                    layer_costs[side].append(cost * weight)
                    if per_head:
                        heads = source["head_sensitivity"][layer][side][c.label]
                        layer_head_costs[side].append(torch.tensor(heads) * weight)
        kept.append(sides)
        costs.append(layer_costs)
        if per_head:
            head_costs.append(layer_head_costs)
    if chosen is not None:
        kept, costs = of_widths(kept, costs, chosen, widths_of)
    check_budget(budget, *bits_range(kept, full_layers(model)))
    sensitivity = Sensitivity(pipes[0], kept, costs, report["tokens"], report["seq_len"], report["measure_seconds"],
                              head_costs, besides[0])
    tuned, out = tuned_for_model(sensitivity, model, budget, per_head)
    tuned.tuned_on = report["domain"]
    for layer in out["layers"]:  # the report keeps the measured costs
        layer["key_kl"] /= key_weight
    for layer in out["sensitivity"]:
        layer["k"] = {label: cost / key_weight for label, cost in layer["k"].items()}
    for layer in out.get("head_sensitivity", []):
        layer["k"] = {label: [cost / key_weight for cost in costs] for label, costs in layer["k"].items()}
    out.update(model=report["model"], domain=report["domain"], reallocated_from=str(src), min_bits=min_bits,
               also=[str(folder) for folder in also], widths_of=None if widths_of is None else str(widths_of),
               whole_widths=whole_widths, key_weight=key_weight,
               predicted_kl=sum(layer["key_kl"] + layer["value_kl"] for layer in out["layers"]))
    return tuned, out


def of_widths(kept: list[dict], costs: list[dict], chosen: dict, folder: Path) -> tuple[list[dict], list[dict]]:
    """Each layer's and side's candidates (and costs) of the width that the per-layer report `chosen` (of `folder`)
    took there."""
    out_kept, out_costs = [], []
    for layer, (sides, layer_costs) in enumerate(zip(kept, costs)):
        picked, narrowed, narrowed_costs = chosen["layers"][layer], {}, {}
        for side, name in (("k", "keys"), ("v", "values")):
            widths = {c.label: c.width for c in sides[side]}
            if picked[name] not in widths:
                raise ValueError(f"--widths-of {folder}: layer {layer}'s {name} {picked[name]!r} is none of the "
                                 f"candidates {sorted(widths)}; reallocate from the folders it was allocated from")
            keep = [i for i, c in enumerate(sides[side]) if c.width == widths[picked[name]]]
            narrowed[side] = [sides[side][i] for i in keep]
            narrowed_costs[side] = [layer_costs[side][i] for i in keep]
        out_kept.append(narrowed)
        out_costs.append(narrowed_costs)
    return out_kept, out_costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="a folder written by `torchkv tune` (with its tune.json)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--budget", type=float, required=True, help="stored bits per value, mean over layers, K and V")
    parser.add_argument("--min-key-bits", type=int, default=1)
    parser.add_argument("--min-value-bits", type=int, default=1)
    parser.add_argument("--key-weight", type=float, default=1.0, help="multiplies the keys' costs in the choice")
    parser.add_argument("--also", type=Path, action="append", default=[],
                        help="a folder tuned from another preset on the same windows: its candidates too (repeatable)")
    parser.add_argument("--widths-of", type=Path, help="a per-layer folder allocated from these folders: keep its "
                        "widths, choose only among candidates of each")
    parser.add_argument("--whole-widths", action="store_true", help="leave out the half-bit key widths")
    args = parser.parse_args()
    tuned, report = reallocate(args.src, args.budget, {"k": args.min_key_bits, "v": args.min_value_bits},
                               args.key_weight, tuple(args.also), args.widths_of, args.whole_widths)
    tuned.save_pretrained(args.out)
    (args.out / "tune.json").write_text(json.dumps(report, indent=2))
    print(f"{stored_bits(report)}, predicted KL {report['predicted_kl']:.4g}; wrote {args.out}")
    for layer in report["layers"]:
        print(f"layer {layer['layer']}: keys {layer['keys']}, values {layer['values']}")


if __name__ == "__main__":
    main()
