"""Where a cache's bytes go: encoded codes and metadata, fitted parameters (predictors, bases), the full-precision
window (its keys and values, and the layer inputs XQuant keeps until encoding), sinks, other; and the total beside
transformers' `DynamicCache` (the `dynamic` row). Fixed-capacity rows (`compiled:PRESET`, and transformers'
`StaticCache` as `static-compiled`) are sized for `--max-cache-len` tokens (default: the prompt and 64 more).

One eval passage of `--tokens` tokens prefilled through each row, then one decode step, so that every cache holds what
it holds while generating (transformers' sliding-window layers keep a view of the whole prompt until their first
step; torchkv's drop the tokens their window passed).

    python benchmarks/cache_bytes.py --presets kivi-2bit,xquant-2bit,xquant-cl-2bit \\
        --out benchmarks/results/xquant/cache_bytes.json
    python benchmarks/cache_bytes.py --model gemma3-270m --tokens 8192 --presets dynamic,kivi-2bit,frontier-2bit
    python benchmarks/cache_bytes.py --model gemma3-270m --tokens 8192 \
        --presets static-compiled,compiled:kivi-2bit,compiled:frontier-2bit
"""

import argparse
from collections import Counter

import torch

import torchkv
from torchkv.corpora import documents
from torchkv.eval.rows import cache_nbytes, method
from torchkv.eval.runner import write_benchmark
from torchkv.models import cache_argument
from torchkv.models.cache import TorchKVCache
from torchkv.models.loader import SMOLLM2
from torchkv.static_store import StaticKVStore
from torchkv.store import KVStore

KINDS = {"res_k": "window_kv", "res_v": "window_kv", "res_x": "window_x", "sink_k": "sinks", "sink_v": "sinks"}


def kind(name: str) -> str:
    if name.startswith("encoded."):
        return "encoded"
    if name.startswith("params."):
        return "params"
    return KINDS.get(name, "other")


@torch.no_grad()
def breakdown(model, ids: torch.Tensor, name: str, max_cache_len: int) -> dict:
    row = method(name)
    if row.pipeline is not None:
        row.pipeline.compile = False  # bytes only: no need to compile
    with row.active(model):
        cache = row.new_cache(model, max_cache_len=max_cache_len)  # the capacity of fixed-capacity rows
        logits = model(ids, **cache_argument(model, cache), use_cache=True, logits_to_keep=1).logits  # [B, 1, vocab]
        model(logits[:, -1:].argmax(-1), **cache_argument(model, cache), use_cache=True)
    bytes_by_kind = Counter()
    torchkv_cache = isinstance(cache, TorchKVCache)
    stores = [store for layer in cache.layers for store in layer.stores()] if torchkv_cache else []
    for store in stores:
        for tensor_name, t in store.tensors().items():
            bytes_by_kind[kind(tensor_name)] += t.untyped_storage().nbytes()
    return {"preset": name, "total_bytes": cache_nbytes(cache), "bytes": dict(bytes_by_kind),
            "encoded_bits_per_value": cache.encoded_bits_per_value() if torchkv_cache else None,
            "tokens_held": [store.length for store in stores if isinstance(store, KVStore)],
            "chunk_slots": [store.chunks for store in stores if isinstance(store, StaticKVStore)]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--presets", default="kivi-2bit,xquant-2bit,xquant-cl-2bit")
    parser.add_argument("--max-cache-len", type=int, help="capacity of fixed-capacity rows (default: tokens + 64)")
    parser.add_argument("--out", default="benchmarks/results/cache_bytes.json")
    args = parser.parse_args(argv)
    capacity = args.max_cache_len or args.tokens + 64
    model, tokenizer = torchkv.load_model(args.model)
    ids = documents(tokenizer, args.tokens, 1)
    rows = [breakdown(model, ids, name, capacity) for name in args.presets.split(",")]
    kinds = sorted({k for r in rows for k in r["bytes"]})
    print("| row | total MiB | " + " | ".join(kinds) + " |")
    for r in rows:
        print(f"| {r['preset']} | {r['total_bytes'] / 2**20:.1f} | "
              + " | ".join(f"{r['bytes'].get(k, 0) / 2**20:.1f}" for k in kinds) + " |")
    write_benchmark(args.out, "cache_bytes", rows, tokens=args.tokens, model=args.model, max_cache_len=capacity)


if __name__ == "__main__":
    main()
