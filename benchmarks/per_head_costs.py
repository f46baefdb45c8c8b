"""Per-KV-head widths, predicted (issue 41's candidate): would letting `torchkv tune` choose each KV head's key and
value width, not each layer's, lower the estimated KL at the same stored bits?

`torchkv tune`'s measurement (`fitting.tuning.sensitivity`) on the calibration split, with each candidate's cost
also split by KV head (`Sensitivity.head_costs`): `½ (g_h·δ_h)²` per head h, besides the layer's
`½ (Σ_h g_h·δ_h)²`. Both allocations run at the same budget (`fitting.tuning.allocate`) and are priced by the
per-head sums, which drop the cross terms between heads; the layer allocation is also priced by its own cost,
which keeps them, to show what dropping them changes. Finer choices fit the measurement's noise more, so the
calibration windows are measured in two disjoint halves, and each allocation is also made on one half and priced
on the other (both ways, averaged).
`torchkv tune --per-head` builds the per-head allocation (`HeadGroups`).

    python benchmarks/per_head_costs.py --tokens 16384 --out benchmarks/results/domains/ablations/per_head_costs.json
"""

import argparse
import collections

import torchkv
from torchkv.corpora import split_articles
from torchkv.eval.runner import write_benchmark
from torchkv.fitting.calibrate import token_windows
from torchkv.fitting.tuning.allocate import allocate
from torchkv.fitting.tuning import sensitivity


def _head_costs(heads, items, n_heads: int) -> list[list[float]]:
    """Per (layer, side, head) item, each candidate's cost."""
    return [[float(c[h]) for c in heads[i][side]] for i, side in items for h in range(n_heads)]


def _priced(choice: list[int], costs: list[list[float]]) -> float:
    return sum(c[j] for c, j in zip(costs, choice))


def _per_head(choice: list[int], n_heads: int) -> list[int]:
    """A per-(layer, side) choice repeated for each of its heads."""
    return [j for j in choice for _ in range(n_heads)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="frontier-2bit")
    parser.add_argument("--domain", default="mixed")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--budgets", default="2.1,2.5")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    model, tokenizer = torchkv.load_model()
    pipe = torchkv.KVPipeline.from_preset(args.preset).for_model(model)
    pipe.compile = False
    ids = token_windows(tokenizer, [t for _, t in split_articles("calibration", args.domain)], args.seq_len, args.tokens)
    halves = [sensitivity.measure(pipe, model, part) for part in ids.chunk(2)]  # disjoint windows
    measured = halves[0]
    items = [(i, side) for i in range(len(measured.costs)) for side in ("k", "v")]
    bits = [[c.bits for c in measured.candidates[i][side]] for i, side in items]
    n_heads = measured.head_costs[0]["k"][0].numel()
    head_bits = [b for b in bits for _ in range(n_heads)]
    layer_costs = [[[m.costs[i][side][j] for j in range(len(bits[n]))] for n, (i, side) in enumerate(items)]
                   for m in halves]
    head_costs = [_head_costs(m.head_costs, items, n_heads) for m in halves]
    whole_layer = [[(a + b) / 2 for a, b in zip(*pair)] for pair in zip(*layer_costs)]  # equal halves: the mean
    whole_head = [[(a + b) / 2 for a, b in zip(*pair)] for pair in zip(*head_costs)]
    rows = []
    for budget in (float(b) for b in args.budgets.split(",")):
        by_layer = allocate(bits, whole_layer, budget)
        by_head = allocate(head_bits, whole_head, budget)
        chosen = collections.defaultdict(list)
        for (i, side), j in zip([it for it in items for _ in range(n_heads)], by_head):
            chosen[f"{i}.{side}"].append(measured.candidates[i][side][j].width)
        held_out = {"layer_widths": 0.0, "head_widths": 0.0}
        for fit, test in ((0, 1), (1, 0)):  # allocate on one half, price on the other, by per-head sums
            held_out["layer_widths"] += _priced(_per_head(allocate(bits, layer_costs[fit], budget), n_heads), head_costs[test]) / 2
            held_out["head_widths"] += _priced(allocate(head_bits, head_costs[fit], budget), head_costs[test]) / 2
        row = {
            "budget": budget,
            "layer_widths": {"bits": sum(b[j] for b, j in zip(bits, by_layer)) / len(items),
                             "kl_layer_cost": _priced(by_layer, whole_layer),
                             "kl_head_sums": _priced(_per_head(by_layer, n_heads), whole_head),
                             "kl_head_sums_held_out": held_out["layer_widths"]},
            "head_widths": {"bits": sum(b[j] for b, j in zip(head_bits, by_head)) / len(head_bits),
                            "kl_head_sums": _priced(by_head, whole_head),
                            "kl_head_sums_held_out": held_out["head_widths"],
                            "widths_where_heads_differ": {k: v for k, v in chosen.items() if len(set(v)) > 1}},
        }
        rows.append(row)
        print(row, flush=True)
    cheapest = [c[0] for c in whole_head]
    share = [max(cheapest[n * n_heads:(n + 1) * n_heads]) / max(sum(cheapest[n * n_heads:(n + 1) * n_heads]), 1e-30)
             for n in range(len(items))]
    write_benchmark(args.out, "per_head_costs", rows, preset=args.preset, domain=args.domain,
                    tokens=sum(m.tokens for m in halves), seq_len=args.seq_len, kv_heads=n_heads,
                    seconds=sum(m.seconds for m in halves), largest_head_share_of_cheapest_cost=share)


if __name__ == "__main__":
    main()
