"""Allocate a tuned folder's measured sensitivities again at another budget, without measuring them again.

`torchkv tune` keeps every candidate's estimated KL in `tune.json`; the allocation is exact and cheap, so a budget
sweep or a candidate-set ablation needs one measurement. The candidates are today's (`CANDIDATE_BITS`) that the
source measured, optionally narrower ones left out, and the keys' costs optionally weighted (an ablation: does
the measurement price keys against values as long contexts do?). A folder tuned per KV head (`--per-head`) is
allocated per head again, from the per-head costs its `tune.json` keeps:

    python benchmarks/reallocate.py SRC_FOLDER OUT_FOLDER --budget 2.1 [--min-key-bits 2] [--min-value-bits 1]
        [--key-weight 2] [--also OTHER_FOLDER]

`--also` adds the candidates of a folder tuned from another preset on the same calibration windows (same model,
domain, tokens and window length), so that each layer, side and head takes the better of both presets' settings
at its width, e.g. keys with and without `rotary_center`. The costs are measured per layer against the same
full-precision gradients, so the merged allocation is the one a joint measurement would make; the candidates the
two folders share (equal chains) must have equal costs, which checks it.
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
from torchkv.fitting.tuning import Sensitivity, bits_range, candidates, check_budget, tuned_for_model
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
               also: Path | None = None) -> tuple[torchkv.KVPipeline, dict]:
    """The tuned pipeline and report of `src`'s measured costs (and `also`'s, see the module docstring) allocated
    at `budget`, over candidates at least `min_bits[side]` wide, the keys' costs multiplied by `key_weight` for the
    choice (the report's costs are the measured ones)."""
    if key_weight <= 0:
        raise ValueError(f"key_weight={key_weight:g}: weight the keys' costs by a positive factor")
    report = json.loads((src / "tune.json").read_text())
    model, _ = torchkv.load_model(report["model"])
    per_head = measured_on(report)["per_head"]  # a folder of `torchkv tune --per-head`: its costs by KV head too
    sources = [(report, "")]
    if also is not None:
        other = json.loads((also / "tune.json").read_text())
        theirs, ours = measured_on(other), measured_on(report)
        if theirs != ours:
            raise ValueError(f"{also} was tuned on other calibration windows than {src} ("
                             + ", ".join(f"{key} {theirs[key]!r} against {ours[key]!r}" for key in ours)
                             + "): tune both on the same model, domain, --tokens and --seq-len")
        sources.append((other, f"{other['preset']}/"))
    pipes = [method(source["preset"]).pipeline.for_model(model) for source, _ in sources]
    config = model.config.get_text_config(decoder=True)
    kept, costs, head_costs = [], [], []
    for layer in range(len(report["sensitivity"])):
        sides, layer_costs, layer_head_costs = {"k": [], "v": []}, {"k": [], "v": []}, {"k": [], "v": []}
        seen: dict[tuple[str, str], float] = {}  # each candidate chain's measured cost, by side and spec
        for (source, prefix), pipe in zip(sources, pipes):
            options = candidates(pipe.for_layer(layer), config.num_key_value_heads, config_head_dim(config))
            measured = source["sensitivity"][layer]
            for side in ("k", "v"):
                weight = key_weight if side == "k" else 1.0
                for c in options[side]:
                    if c.width < min_bits[side] or c.label not in measured[side]:
                        continue
                    item, cost = (side, chain_spec(Chain(list(c.transforms)))), measured[side][c.label]
                    if item in seen:  # measured by both: the same windows give the same cost, to float noise
                        if not math.isclose(cost, seen[item], rel_tol=SAME_COST, abs_tol=SAME_COST * 1e-3):
                            raise ValueError(f"layer {layer}'s {c.label} costs {cost:.6g} in {also} and "
                                             f"{seen[item]:.6g} in {src}: they were measured on other windows")
                        continue
                    seen[item] = cost
                    sides[side].append(dataclasses.replace(c, label=prefix + c.label))
                    layer_costs[side].append(cost * weight)
                    if per_head:
                        heads = source["head_sensitivity"][layer][side][c.label]
                        layer_head_costs[side].append(torch.tensor(heads) * weight)
        kept.append(sides)
        costs.append(layer_costs)
        if per_head:
            head_costs.append(layer_head_costs)
    check_budget(budget, *bits_range(kept))
    sensitivity = Sensitivity(pipes[0], kept, costs, report["tokens"], report["seq_len"], report["measure_seconds"],
                              head_costs)
    tuned, out = tuned_for_model(sensitivity, model, budget, per_head)
    tuned.tuned_on = report["domain"]
    for layer in out["layers"]:  # the report keeps the measured costs
        layer["key_kl"] /= key_weight
    for layer in out["sensitivity"]:
        layer["k"] = {label: cost / key_weight for label, cost in layer["k"].items()}
    for layer in out.get("head_sensitivity", []):
        layer["k"] = {label: [cost / key_weight for cost in costs] for label, costs in layer["k"].items()}
    out.update(model=report["model"], domain=report["domain"], reallocated_from=str(src), min_bits=min_bits,
               also=None if also is None else str(also),
               key_weight=key_weight, predicted_kl=sum(layer["key_kl"] + layer["value_kl"] for layer in out["layers"]))
    return tuned, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="a folder written by `torchkv tune` (with its tune.json)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--budget", type=float, required=True, help="stored bits per value, mean over layers, K and V")
    parser.add_argument("--min-key-bits", type=int, default=1)
    parser.add_argument("--min-value-bits", type=int, default=1)
    parser.add_argument("--key-weight", type=float, default=1.0, help="multiplies the keys' costs in the choice")
    parser.add_argument("--also", type=Path, help="a folder tuned from another preset on the same windows: its "
                        "candidates too")
    args = parser.parse_args()
    tuned, report = reallocate(args.src, args.budget, {"k": args.min_key_bits, "v": args.min_value_bits},
                               args.key_weight, args.also)
    tuned.save_pretrained(args.out)
    (args.out / "tune.json").write_text(json.dumps(report, indent=2))
    print(f"{report['bits_per_value']:.4g} stored bits per value, predicted KL {report['predicted_kl']:.4g}; "
          f"wrote {args.out}")
    for layer in report["layers"]:
        print(f"layer {layer['layer']}: keys {layer['keys']}, values {layer['values']}")


if __name__ == "__main__":
    main()
