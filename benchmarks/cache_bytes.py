"""Where a compressed cache's bytes go: encoded codes and metadata, fitted parameters (predictors, bases),
the full-precision window (its keys and values, and the layer inputs XQuant keeps until encoding), other.

SmolLM2, one Wikipedia eval passage of `--tokens` tokens prefilled through each patched preset.

    python benchmarks/cache_bytes.py --presets kivi-2bit,xquant-2bit,xquant-cl-2bit \\
        --out benchmarks/results/xquant/cache_bytes.json
"""

import argparse
from collections import Counter

import torch

import torchkv
from torchkv.corpora import documents
from torchkv.eval.rows import method
from torchkv.eval.runner import write_benchmark

KINDS = {"res_k": "window_kv", "res_v": "window_kv", "res_x": "window_x", "sink_k": "sinks", "sink_v": "sinks"}


def kind(name: str) -> str:
    if name.startswith("encoded."):
        return "encoded"
    if name.startswith("params."):
        return "params"
    return KINDS.get(name, "other")


@torch.no_grad()
def breakdown(model, ids: torch.Tensor, name: str) -> dict:
    row = method(name)
    if row.pipeline is not None:
        row.pipeline.compile = False  # bytes only: no need to compile
    with row.active(model):
        cache = row.new_cache(model)
        model(ids, **torchkv.models.cache_argument(model, cache), use_cache=True)
    bytes_by_kind = Counter()
    for layer in cache.layers:
        for tensor_name, t in layer.store.tensors().items():
            bytes_by_kind[kind(tensor_name)] += t.untyped_storage().nbytes()
    return {"preset": name, "total_bytes": cache.nbytes(), "bytes": dict(bytes_by_kind),
            "encoded_bits_per_value": cache.encoded_bits_per_value()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--presets", default="kivi-2bit,xquant-2bit,xquant-cl-2bit")
    parser.add_argument("--out", default="benchmarks/results/cache_bytes.json")
    args = parser.parse_args(argv)
    model, tokenizer = torchkv.load_model()
    ids = documents(tokenizer, args.tokens, 1)
    rows = [breakdown(model, ids, name) for name in args.presets.split(",")]
    kinds = sorted({k for r in rows for k in r["bytes"]})
    print("| preset | total MiB | " + " | ".join(kinds) + " |")
    for r in rows:
        print(f"| {r['preset']} | {r['total_bytes'] / 2**20:.1f} | "
              + " | ".join(f"{r['bytes'].get(k, 0) / 2**20:.1f}" for k in kinds) + " |")
    write_benchmark(args.out, "cache_bytes", rows, tokens=args.tokens)


if __name__ == "__main__":
    main()
