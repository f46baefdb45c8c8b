"""Per-KV-head widths, predicted (issue 41's candidate): would letting `torchkv tune` choose each KV head's key and
value width, not each layer's, lower the estimated KL at the same stored bits?

`torchkv tune`'s measurement (`fitting.tuning.sensitivity`) on the calibration split, with each candidate's cost
also split by KV head: `½ (g_h·δ_h)²` per head h, besides the layer's `½ (Σ_h g_h·δ_h)²`. Both allocations run at
the same budget (`fitting.tuning.allocate`) and are priced by the per-head sums, which drop the cross terms
between heads; the layer allocation is also priced by its own cost, which keeps them, to show what dropping
them changes. Nothing here builds a per-head pipeline: the store has one width per layer and side.

    python benchmarks/per_head_costs.py --tokens 16384 --out benchmarks/results/domains/ablations/per_head_costs.json
"""

import argparse
import collections

import torch

import torchkv
from torchkv.corpora import split_articles
from torchkv.eval.runner import write_benchmark
from torchkv.fitting.calibrate import token_windows
from torchkv.fitting.tuning.allocate import allocate
from torchkv.fitting.tuning import sensitivity


def measure_per_head(pipe, model, ids) -> tuple[sensitivity.Sensitivity, list[dict[str, list[torch.Tensor]]]]:
    """`sensitivity.measure`, and per layer, side and candidate the per-head costs `[H]` (nats per token)."""
    per_head: dict[int, dict[str, dict[int, torch.Tensor]]] = collections.defaultdict(
        lambda: collections.defaultdict(dict))

    @torch.no_grad()
    def layer_costs(pipe, layer, probe, trials, grads, tokens, inputs, costs):
        for (side, j), trial in trials.items():
            start, end = span = sensitivity._flush_span(trial, tokens)
            delta = sensitivity._reconstruct(trial, layer, probe, span, inputs, side)[0][side]
            for dk, dv in grads:
                dots = ((dk if side == "k" else dv)[:, :, start:end].float() * delta).sum((2, 3))  # [B, H]
                costs[side][j] += 0.5 * float(dots.sum(1).pow(2).sum()) / len(grads)
                head = per_head[layer][side]
                head[j] = head.get(j, 0) + 0.5 * dots.pow(2).sum(0) / len(grads)
        return {}

    original = sensitivity._layer_costs
    sensitivity._layer_costs = layer_costs
    try:
        measured = sensitivity.measure(pipe, model, ids)
    finally:
        sensitivity._layer_costs = original
    tokens = measured.tokens
    return measured, [{side: [per_head[i][side][j] / tokens for j in range(len(measured.costs[i][side]))]
                       for side in ("k", "v")} for i in range(len(measured.costs))]


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
    measured, heads = measure_per_head(pipe, model, ids)
    layers = range(len(measured.costs))
    items = [(i, side) for i in layers for side in ("k", "v")]
    bits = [[c.bits for c in measured.candidates[i][side]] for i, side in items]
    n_heads = heads[0]["k"][0].numel()
    rows = []
    for budget in (float(b) for b in args.budgets.split(",")):
        by_layer = allocate(bits, [measured.costs[i][side] for i, side in items], budget)
        head_items = [(i, side, h) for i, side in items for h in range(n_heads)]
        head_bits = [b for b in bits for _ in range(n_heads)]
        head_costs = [[float(c[h]) for c in heads[i][side]] for i, side, h in head_items]
        by_head = allocate(head_bits, head_costs, budget)
        layer_choice_heads = [j for j in by_layer for _ in range(n_heads)]
        row = {
            "budget": budget,
            "layer_widths": {"bits": sum(b[j] for b, j in zip(bits, by_layer)) / len(items),
                             "kl_layer_cost": sum(measured.costs[i][s][j] for (i, s), j in zip(items, by_layer)),
                             "kl_head_sums": sum(c[j] for c, j in zip(head_costs, layer_choice_heads))},
            "head_widths": {"bits": sum(b[j] for b, j in zip(head_bits, by_head)) / len(head_items),
                            "kl_head_sums": sum(c[j] for c, j in zip(head_costs, by_head))},
        }
        chosen = collections.defaultdict(list)
        for (i, s, _), j in zip(head_items, by_head):
            chosen[f"{i}.{s}"].append(measured.candidates[i][s][j].width)
        row["head_widths"]["widths_where_heads_differ"] = {k: v for k, v in chosen.items() if len(set(v)) > 1}
        rows.append(row)
        print(row, flush=True)
    share = [max(float(c) for c in heads[i][s][0]) / max(float(heads[i][s][0].sum()), 1e-30) for i, s in items]
    write_benchmark(args.out, "per_head_costs", rows, preset=args.preset, domain=args.domain, tokens=measured.tokens,
                    seq_len=args.seq_len, kv_heads=n_heads, seconds=measured.seconds,
                    largest_head_share_of_cheapest_cost=share)


if __name__ == "__main__":
    main()
