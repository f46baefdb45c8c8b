"""XQuant App. B on SmolLM2: how often the weight-only prediction of the outlier key channel is right.

The prediction is the top-k |entries| of b_0, the first right singular vector of a layer's W_k
(`torchkv.methods.xquant.key_outlier_channels`). The truth is the pre-RoPE key channel with the largest
mean |K| over a held-out passage, with K = X·W_k (+ bias) from the captured layer inputs X. A layer is a hit
when the truth is among the top k (the paper's Table B.2).

    python benchmarks/xquant_outliers.py --out benchmarks/results/xquant/outliers.json
"""

import argparse

import torch

import torchkv
from torchkv.corpora import documents
from torchkv.eval.runner import write_benchmark
from torchkv.methods.xquant import key_outlier_channels
from torchkv.models.capture import capture_qkv
from torchkv.models.weights import projection_weights


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", default="benchmarks/results/xquant/outliers.json")
    args = parser.parse_args(argv)
    model, tokenizer = torchkv.load_model()
    _, layers = capture_qkv(model, documents(tokenizer, args.tokens, 1), layer_inputs=True)
    rows = []
    for layer, ((*_, x), w) in enumerate(zip(layers, projection_weights(model))):
        keys = x[0].float() @ w.k.float() + (0 if w.k_bias is None else w.k_bias.float())  # [T, H·D]
        truth = int(keys.abs().mean(0).argmax())
        rows.append({"layer": layer, "truth": truth, "predicted": key_outlier_channels(w.k.float(), 8).tolist()})
    hits = {k: sum(r["truth"] in r["predicted"][:k] for r in rows) / len(rows) for k in (1, 2, 4, 8)}
    print("top-k hit rate over layers:", {k: f"{100 * v:.1f}%" for k, v in hits.items()})
    write_benchmark(args.out, "xquant_outliers", rows, tokens=args.tokens, hit_rate=hits)


if __name__ == "__main__":
    main()
