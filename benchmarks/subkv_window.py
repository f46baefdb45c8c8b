"""SubKV's dynamic window over a generation: how long the full-precision windows get, and what they cost.

After a held-out Wikipedia prompt, greedy decoding runs through each row's cache; after every step the
window length (full-precision tokens after the sink) of each of the 30 layers is recorded. Reported per
row: mean and max window length over steps and layers, the largest window bound any layer reached,
how many layers grew at all, the cache bytes at the end, and decode tokens/s (the generation runs
twice; the second, with every graph already compiled, is timed).

    python benchmarks/subkv_window.py --out benchmarks/results/subkv_window.json
"""

import argparse
import time

import torch

import torchkv
from torchkv.corpora import documents
from torchkv.eval.rows import method
from torchkv.eval.runner import write_benchmark


@torch.no_grad()
def window_profile(model, ids: torch.Tensor, row: str, new_tokens: int) -> dict:
    """Greedy-decode `new_tokens` after `ids` through the row's cache, recording window lengths per step."""
    m = method(row)
    with m.active(model):
        for _ in range(2):  # the first run compiles
            cache = m.new_cache(model)
            passed = torchkv.models.cache_argument(model, cache)
            logits = model(input_ids=ids, **passed, use_cache=True, logits_to_keep=1).logits
            lengths = []  # [steps][layers]
            started = time.perf_counter()
            for _ in range(new_tokens):
                token = logits[:, -1:].argmax(-1)
                logits = model(input_ids=token, **passed, use_cache=True).logits
                lengths.append([layer.store.n_residual for layer in cache.layers])
            seconds = time.perf_counter() - started
    steps = torch.tensor(lengths, dtype=torch.float64)
    limits = [layer.store.window_limit for layer in cache.layers]
    base = m.pipeline.residual + m.pipeline.chunk
    return {
        "row": row,
        "mean_window": float(steps.mean()),
        "max_window": int(steps.max()),
        "largest_bound": max(limits),
        "layers_grown": sum(limit > base for limit in limits),
        "decode_tokens_per_s": new_tokens / seconds,
        "cache_bytes": cache.nbytes(),
        "window_bytes": sum(layer.store.recent.k.untyped_storage().nbytes() + layer.store.recent.v.untyped_storage().nbytes()
                            for layer in cache.layers),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--rows", default="subkv-2bit,subkv-2bit:dynamic=False,subkv-4bit,subkv-4bit:dynamic=False")
    parser.add_argument("--out", default="benchmarks/results/subkv_window.json")
    args = parser.parse_args(argv)
    model, tokenizer = torchkv.load_model()
    ids = documents(tokenizer, args.prompt, 1)
    rows = []
    print("| row | mean window | max window | largest bound | layers grown | cache MiB | window buffers MiB "
          "| decode tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in args.rows.split(","):
        r = window_profile(model, ids, row, args.new_tokens)
        rows.append(r)
        print(f"| {row} | {r['mean_window']:.1f} | {r['max_window']} | {r['largest_bound']} | {r['layers_grown']}/30 "
              f"| {r['cache_bytes'] / 2**20:.2f} | {r['window_bytes'] / 2**20:.2f} | {r['decode_tokens_per_s']:.1f} |",
              flush=True)
    write_benchmark(args.out, "subkv_window", rows, prompt=args.prompt, new_tokens=args.new_tokens)


if __name__ == "__main__":
    main()
