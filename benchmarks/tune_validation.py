"""Does the tuner's predicted cost rank pipelines as their measured quality does?

For each starting preset, the sensitivities are measured once on the calibration split (`torchkv tune`'s
estimate of each layer's and side's next-token KL at each width). Then, for a handful of allocations (every
layer at one (keys, values) width pair, and tuned allocations at a few budgets), the predicted KL (the sum of
the chosen costs) is compared with the KL and the perplexity measured through the real compressed cache,
streaming held-out documents in 64-token blocks. Spearman's rank correlation is reported for both.

    python benchmarks/tune_validation.py --presets kivi-2bit,frontier-2bit --out benchmarks/results/tune/validation.json
"""

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

import torchkv
from torchkv.corpora import documents
from torchkv.eval.rows import Method, method
from torchkv.eval.runner import machine
from torchkv.pipeline import KVPipeline
from torchkv.fitting.tuning import calibration_sensitivity, tuned_pipeline
from torchkv.fitting.tuning.candidates import tuned_chunk
from torchkv.fitting.tuning.sensitivity import Sensitivity


@torch.no_grad()
def streamed_kl_and_ppl(model, docs: torch.Tensor, row: Method, block: int = 64) -> tuple[float, float]:
    """Mean next-token KL(full precision ‖ row) in nats, and perplexity, over `docs` [N, L] streamed through the
    row's cache in `block`-token blocks (the reference distributions from one full-precision forward per document)."""
    kl = nll = 0.0
    count = 0
    with row.active(model):
        for doc in docs:
            reference = torch.log_softmax(model(input_ids=doc[None], use_cache=False).logits[0].float(), -1)
            cache = row.new_cache(model)
            passed = torchkv.models.cache_argument(model, cache)
            for start in range(0, doc.numel(), block):
                ids = doc[None, start : start + block]
                logp = torch.log_softmax(model(input_ids=ids, **passed, use_cache=True).logits[0].float(), -1)
                ref = reference[start : start + ids.shape[1]]
                kl += float((ref.exp() * (ref - logp)).sum())
                targets = doc[start + 1 : start + ids.shape[1] + 1]
                nll -= float(logp[: targets.numel()].gather(1, targets[:, None]).sum())
                count += ids.shape[1]
    return kl / count, float(torch.exp(torch.tensor(nll / (count - docs.shape[0]))))


def uniform(sensitivity: Sensitivity, k: int, v: int) -> tuple[KVPipeline, float, float]:
    """Every layer at its k-th key and v-th value candidate: the pipeline, its bits and predicted KL."""
    base = sensitivity.pipeline
    layers = {i: (list(c["k"][k].transforms), list(c["v"][v].transforms)) for i, c in enumerate(sensitivity.candidates)}
    chunk = tuned_chunk(base, [c["k"][k].transforms for c in sensitivity.candidates]
                        + [c["v"][v].transforms for c in sensitivity.candidates])
    pipe = KVPipeline(*layers[len(layers) - 1], layers=layers, residual=base.residual, sinks=base.sinks,
                      chunk=chunk, window=base.window)
    cands = sensitivity.candidates
    bits = sum(c["k"][k].bits + c["v"][v].bits for c in cands) / (2 * len(cands))
    predicted = sum(c["k"][k] + c["v"][v] for c in sensitivity.costs)
    return pipe, bits, predicted


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    for r, i in enumerate(order):
        ranks[i] = float(r)
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="kivi-2bit,frontier-2bit")
    parser.add_argument("--max-width", type=int, default=4, help="uniform settings: every (key, value) pair of "
                        "candidates up to this width, keys and values at one of --group-scales")
    parser.add_argument("--group-scales", default="1", help="multiples of the preset's group of the uniform settings")
    parser.add_argument("--budgets", default="2.5,3", help="budgets of tuned allocations, per preset")
    parser.add_argument("--tokens", type=int, default=32768, help="calibration tokens of the sensitivities")
    parser.add_argument("--docs", default="2048:2", help="held-out documents, length:count")
    parser.add_argument("--out", default="benchmarks/results/tune/validation.json")
    args = parser.parse_args()
    model, tokenizer = torchkv.load_model()
    length, count = map(int, args.docs.split(":"))
    docs = documents(tokenizer, length, count)
    results = {"meta": {"machine": machine(), "args": vars(args), "started": time.strftime("%Y-%m-%dT%H:%M:%S")},
               "presets": {}}
    for name in args.presets.split(","):
        sensitivity = calibration_sensitivity(method(name).pipeline, model, tokenizer, args.tokens)
        settings = []
        last = sensitivity.candidates[-1]
        scales = {int(x) for x in args.group_scales.split(",")}
        own = {side: [j for j, c in enumerate(cs) if c.group_scale in scales and c.width <= args.max_width]
               for side, cs in last.items()}
        for k, v in itertools.product(own["k"], own["v"]):
            if last["k"][k].group_scale == last["v"][v].group_scale:
                pipe, bits, predicted = uniform(sensitivity, k, v)
                settings.append((f"uniform K {last['k'][k].label} V {last['v'][v].label}", pipe, bits, predicted))
        for budget in map(float, args.budgets.split(",")):
            pipe, report = tuned_pipeline(sensitivity, budget)
            settings.append((f"tuned @{budget:g}", pipe, report["bits_per_value"], report["predicted_kl"]))
        rows = []
        for label, pipe, bits, predicted in settings:
            pipe.name = f"{name} {label}"
            started = time.perf_counter()
            kl, ppl = streamed_kl_and_ppl(model, docs, Method(pipe.name, pipeline=pipe))
            rows.append({"setting": label, "bits_per_value": bits, "predicted_kl": predicted, "measured_kl": kl,
                         "ppl": ppl, "seconds": time.perf_counter() - started})
            print(f"{name:16s} {label:36s} bits {bits:.3f} predicted KL {predicted:.4f} measured KL {kl:.4f} ppl {ppl:.3f}",
                  flush=True)
        predicted = [r["predicted_kl"] for r in rows]
        results["presets"][name] = {
            "sensitivity_seconds": sensitivity.seconds, "tokens": sensitivity.tokens, "settings": rows,
            "spearman_predicted_vs_measured_kl": spearman(predicted, [r["measured_kl"] for r in rows]),
            "spearman_predicted_vs_ppl": spearman(predicted, [r["ppl"] for r in rows]),
        }
        print(name, {k: v for k, v in results["presets"][name].items() if k.startswith("spearman")}, flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
