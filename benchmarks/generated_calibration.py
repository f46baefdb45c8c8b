"""Tune on the model's own text: windows sampled from the model at temperature 1 from its BOS token, so that the
calibration text is no evaluation domain (an ablation of issue 41's cross-domain rows: tuned on one domain, a
folder misses 2% on the others).

    python benchmarks/generated_calibration.py OUT_FOLDER [--model smollm2-135m] [--preset frontier-2bit]
        [--budget 2.5] [--tokens 32768] [--seq-len 2048] [--per-head] [--seed 0] [--batch 8]

Writes OUT_FOLDER as `torchkv tune --out` does (its `tune.json` names the domain "generated" and the sampling), and
OUT_FOLDER/samples.txt, the sampled text, so that what it was tuned on can be read. On SmolLM2 (stop 101, RESULTS.md)
such a folder misses 2% on code and docs in prompt mode where one tuned on the mixed split does not.
"""

import argparse
import json
import time
from pathlib import Path

import torch

import torchkv
from torchkv.eval.rows import method
from torchkv.fitting.tuning import stored_bits, tune


def sampled_windows(model, tokenizer, windows: int, seq_len: int, seed: int, batch: int) -> torch.Tensor:
    """`[windows, seq_len]` token ids sampled from `model` at temperature 1 (no top-k or top-p), each window
    started from the BOS token and held to `seq_len` tokens (no end-of-text is sampled before)."""
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(seed)
    rows = []
    for first in range(0, windows, batch):
        ids = torch.full((min(batch, windows - first), 1), start)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=seq_len - 1, min_new_tokens=seq_len - 1,
                             pad_token_id=tokenizer.eos_token_id)
        rows.append(out)
        print(f"sampled {first + len(out)} of {windows} windows", flush=True)
    return torch.cat(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--preset", default="frontier-2bit")
    parser.add_argument("--budget", type=float, default=2.5)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--per-head", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8, help="windows sampled at once")
    args = parser.parse_args()

    model, tokenizer = torchkv.load_model(args.model)
    started = time.perf_counter()
    ids = sampled_windows(model, tokenizer, args.tokens // args.seq_len, args.seq_len, args.seed, args.batch)
    sampling_seconds = time.perf_counter() - started
    tuned, report = tune(method(args.preset).pipeline, model, ids, budget=args.budget, seq_len=args.seq_len,
                         max_tokens=args.tokens, domain="generated", per_head=args.per_head)
    out = Path(args.out)
    tuned.save_pretrained(out)
    report.update(sampling=f"temperature 1 from BOS, seed {args.seed}, {len(ids)} windows of {args.seq_len} tokens",
                  sampling_seconds=sampling_seconds)
    (out / "tune.json").write_text(json.dumps({"model": args.model, **report}, indent=2))
    (out / "samples.txt").write_text("\n\n=====\n\n".join(tokenizer.decode(row[1:]) for row in ids))
    print(f"tuned '{args.preset}' to {stored_bits(report)} on {len(ids)} sampled windows in "
          f"{report['seconds']:.0f} s (sampling {sampling_seconds:.0f} s); wrote {out}")


if __name__ == "__main__":
    main()
