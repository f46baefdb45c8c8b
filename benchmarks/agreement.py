"""Greedy generation through each preset's cache against DynamicCache, and cache bytes at 2K tokens.

For every preset: the number of leading generated tokens identical to DynamicCache's (64 greedy tokens
after a ~1,000-token held-out Wikipedia prompt), and the bytes held after a 2,048-token prompt against
DynamicCache's, both measured on SmolLM2-135M-Instruct in float32.

    python benchmarks/agreement.py --out benchmarks/results/agreement.json
"""

import argparse

import torch
from transformers import DynamicCache

import torchkv
from torchkv.corpora import documents
from torchkv.eval.runner import write_benchmark
from torchkv.eval.rows import cache_nbytes
from torchkv.models import cache_argument


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bytes-at", type=int, default=2048)
    parser.add_argument("--presets", default=",".join(p["name"] for p in torchkv.presets() if not p["calibrate"]),
                        help="presets or calibrated pipeline folders")
    parser.add_argument("--out", default="benchmarks/results/agreement.json")
    args = parser.parse_args(argv)
    model, tokenizer = torchkv.load_model()
    prompt, long = documents(tokenizer, args.prompt, 1), documents(tokenizer, args.bytes_at, 1)
    settings = {"max_new_tokens": args.new_tokens, "do_sample": False, "min_new_tokens": args.new_tokens}
    reference = model.generate(prompt, **cache_argument(model, DynamicCache(config=model.config)), **settings)
    reference = reference[0, args.prompt:]
    full = DynamicCache(config=model.config)
    model(long, **cache_argument(model, full))
    full_bytes = cache_nbytes(full)
    rows = []
    print(f"| preset | tokens matching DynamicCache (of {args.new_tokens}) | cache bytes at {args.bytes_at} | vs DynamicCache |")
    print("|---|---|---|---|")
    for name in args.presets.split(","):
        with torchkv.patched(model, name):
            out = model.generate(prompt, **settings)[0, args.prompt:]
            cache = torchkv.new_cache(model)
            model(long, **torchkv.models.cache_argument(model, cache))
        differ = (out != reference).nonzero()
        matching = int(differ[0, 0]) if differ.numel() else args.new_tokens
        row = {"preset": name, "matching_tokens": matching, "cache_bytes": cache.nbytes(),
               "dynamic_cache_bytes": full_bytes, "ratio": cache.nbytes() / full_bytes}
        rows.append(row)
        print(f"| {name} | {matching} | {row['cache_bytes']:,} | {row['ratio']:.3f} |", flush=True)
    write_benchmark(args.out, "agreement", rows, prompt=args.prompt, new_tokens=args.new_tokens,
                    bytes_at=args.bytes_at)


if __name__ == "__main__":
    main()
