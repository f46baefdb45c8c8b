"""Allocate a tuned folder's measured sensitivities again at another budget, without measuring them again.

`torchkv tune` keeps every candidate's estimated KL in `tune.json`; the allocation is exact and cheap, so a budget
sweep or a candidate-set ablation needs one measurement. The candidates are today's (`CANDIDATE_BITS`) that the
source measured, optionally narrower ones left out, and the keys' costs optionally weighted (an ablation: does
the measurement price keys against values as long contexts do?). A folder tuned per KV head (`--per-head`) is
allocated per head again, from the per-head costs its `tune.json` keeps:

    python benchmarks/reallocate.py SRC_FOLDER OUT_FOLDER --budget 2.1 [--min-key-bits 2] [--min-value-bits 1]
        [--key-weight 2]
"""

import argparse
import json
from pathlib import Path

import torch

import torchkv
from torchkv._compat import config_head_dim
from torchkv.eval.rows import method
from torchkv.fitting.tuning import Sensitivity, bits_range, candidates, check_budget, tuned_for_model


def reallocate(src: Path, budget: float, min_bits: dict[str, int], key_weight: float = 1.0
               ) -> tuple[torchkv.KVPipeline, dict]:
    """The tuned pipeline and report of `src`'s measured costs allocated at `budget`, over candidates at least
    `min_bits[side]` wide, the keys' costs multiplied by `key_weight` for the choice (the report's costs are the
    measured ones)."""
    if key_weight <= 0:
        raise ValueError(f"key_weight={key_weight:g}: weight the keys' costs by a positive factor")
    report = json.loads((src / "tune.json").read_text())
    model, _ = torchkv.load_model(report["model"])
    pipe = method(report["preset"]).pipeline.for_model(model)
    config = model.config.get_text_config(decoder=True)
    per_head = report.get("per_head", False)  # a folder of `torchkv tune --per-head`: its costs by KV head too
    kept, costs, head_costs = [], [], []
    for layer, measured in enumerate(report["sensitivity"]):
        options = candidates(pipe.for_layer(layer), config.num_key_value_heads, config_head_dim(config))
        sides = {side: [c for c in options[side] if c.width >= min_bits[side] and c.label in measured[side]]
                 for side in ("k", "v")}
        kept.append(sides)
        costs.append({side: [measured[side][c.label] * (key_weight if side == "k" else 1.0) for c in sides[side]]
                      for side in ("k", "v")})
        if per_head:
            heads = report["head_sensitivity"][layer]
            head_costs.append({side: [torch.tensor(heads[side][c.label]) * (key_weight if side == "k" else 1.0)
                                      for c in sides[side]] for side in ("k", "v")})
    check_budget(budget, *bits_range(kept))
    sensitivity = Sensitivity(pipe, kept, costs, report["tokens"], report["seq_len"], report["measure_seconds"],
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
    args = parser.parse_args()
    tuned, report = reallocate(args.src, args.budget, {"k": args.min_key_bits, "v": args.min_value_bits},
                               args.key_weight)
    tuned.save_pretrained(args.out)
    (args.out / "tune.json").write_text(json.dumps(report, indent=2))
    print(f"{report['bits_per_value']:.4g} stored bits per value, predicted KL {report['predicted_kl']:.4g}; "
          f"wrote {args.out}")
    for layer in report["layers"]:
        print(f"layer {layer['layer']}: keys {layer['keys']}, values {layer['values']}")


if __name__ == "__main__":
    main()
