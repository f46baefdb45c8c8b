"""Why a harness must score through the cache: needle answers scored by one forward pass over context and answer
(what a harness does with a patched model) and by torchkv's scoring (context prefilled into the compressed cache,
answer read through it), for several presets on SmolLM2.

    python benchmarks/naive_vs_cache.py --out benchmarks/results/long/naive_vs_cache.json

Writes the JSON and a PNG beside it (mean answer log-probability and greedy accuracy of each path per preset).
"""

import argparse
import json
import time
from pathlib import Path

import torch

import torchkv
from torchkv.eval.rows import method
from torchkv.eval.runner import machine
from torchkv.eval.synthetic import needle_sample
from torchkv.eval.through_cache import Request, score


def _ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False).input_ids)


@torch.no_grad()
def naive(model, row, request: Request) -> tuple[float, bool]:
    """(log-probability, greedy) of the continuation from one forward pass over the whole text: no token is read
    from the cache, whatever the row stores."""
    ids = torch.tensor(request.cached + request.asked + request.continuation)
    with row.active(model):
        logits = model(ids[None]).logits[0].float().log_softmax(-1)
    n, target = ids.numel() - len(request.continuation), torch.tensor(request.continuation)
    rows = logits[n - 1 : ids.numel() - 1]
    return float(rows.gather(1, target[:, None]).sum()), bool(torch.equal(rows.argmax(-1), target))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="fp16,kivi-4bit,kivi-2bit,frontier-2bit")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results/long/naive_vs_cache.json")
    args = parser.parse_args()
    model, tokenizer = torchkv.load_model()
    depths = [i / max(1, args.samples - 1) for i in range(args.samples)]
    samples = [needle_sample(tokenizer, args.length, d, seed=i) for i, d in enumerate(depths)]
    requests = [Request(_ids(tokenizer, s.context), _ids(tokenizer, s.target), _ids(tokenizer, s.question))
                for s in samples]
    rows = []
    for name in args.presets.split(","):
        row, start = method(name), time.perf_counter()
        through = score(model, row, requests, progress=True)
        single = [naive(model, row, r) for r in requests]
        rows.append({"preset": name,
                     "through_cache": {"logprob": [s.logprob for s in through], "greedy": [s.greedy for s in through]},
                     "naive": {"logprob": [lp for lp, _ in single], "greedy": [g for _, g in single]},
                     "seconds": time.perf_counter() - start})
        print(f"{name}: through the cache {sum(s.greedy for s in through)}/{len(requests)} greedy, "
              f"naive {sum(g for _, g in single)}/{len(requests)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": "smollm2-135m", "task": "needle", "length": args.length, "depths": depths,
            "machine": machine()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"), args.length)
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(rows: list[dict], path: Path, length: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["preset"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, field, label in ((axes[0], "logprob", "mean answer log-probability"),
                             (axes[1], "greedy", "greedy accuracy")):
        for k, (path_name, colour) in enumerate((("naive", "#999999"), ("through_cache", "#1f77b4"))):
            values = [sum(map(float, r[path_name][field])) / len(r[path_name][field]) for r in rows]
            ax.bar([i + (k - 0.5) * 0.38 for i in range(len(rows))], values, 0.38, color=colour,
                   label="one forward pass (naive)" if path_name == "naive" else "through the cache (torchkv)")
        ax.set_xticks(range(len(rows)), names)
        ax.set_ylabel(label)
    axes[0].legend(loc="lower left", fontsize=8)
    fig.suptitle(f"SmolLM2, needle at {length} tokens: the naive path scores every preset alike")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
