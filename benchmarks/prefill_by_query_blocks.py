"""One prompt's prefill through transformers' `DynamicCache`: transformers' SDPA against the same attention by query
blocks (`models.prompt_attention.transformers_sdpa_by_query_blocks`), which the long-context evaluations give
full-precision rows. On a model with sliding-window layers, SDPA computes every tile of each local layer's masked score
matrix.

    python benchmarks/prefill_by_query_blocks.py --model gemma3-270m --lengths 8192,16384 \\
        --out benchmarks/results/gemma3/prefill_by_query_blocks_gemma3.json

Each length runs by query blocks first, then through SDPA, on the same random token ids; the JSON gives the seconds
of each and the largest difference of their last logits.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from torchkv.eval.runner import machine
from torchkv.models.arch import swapped_attention
from torchkv.models.loader import load_model
from torchkv.models.prompt_attention import transformers_sdpa_by_query_blocks


def _prefill(model, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(seconds, last logits [1, 1, V]) of one forward pass over `ids` into a fresh `DynamicCache`."""
    started = time.perf_counter()
    logits = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), logits_to_keep=1).logits
    return time.perf_counter() - started, logits


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--lengths", default="8192,16384", help="prompt lengths, comma-separated")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    model, _ = load_model(args.model)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(100, min(vocab, 20000), (1, n), generator=torch.Generator().manual_seed(n))
        with swapped_attention(model, "sdpa_by_query_blocks", transformers_sdpa_by_query_blocks):
            blocks, by_blocks = _prefill(model, ids)
        sdpa, by_sdpa = _prefill(model, ids)
        rows.append({"length": n, "by_query_blocks_s": blocks, "sdpa_s": sdpa, "speedup": sdpa / blocks,
                     "max_abs_logit_diff": (by_sdpa - by_blocks).abs().max().item()})
        print(rows[-1], flush=True)
    result = {"model": args.model, "dtype": str(model.dtype), "machine": machine(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
