"""Where one preset's decode step spends its time: torch.profiler over a few decode steps of SmolLM2.

    python benchmarks/profile_decode.py --preset xquant-cl-2bit --context 4096 --out benchmarks/results/decode/profile_xquant-cl-2bit.json

Writes the operators with the largest self time (CPU, and CUDA on a GPU) per decode step.
"""

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import torchkv
from torchkv.corpora import token_stream
from torchkv.eval.rows import method


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    model, tokenizer = torchkv.load_model()
    model.to(args.device)
    row = method(args.preset)
    ids = token_stream(tokenizer, "eval")[None, : args.context].to(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with row.active(model):
        cache = row.new_cache(model)
        passed = torchkv.models.cache_argument(model, cache)
        logits = model(input_ids=ids, **passed, logits_to_keep=1).logits
        for _ in range(3):  # compile the decode graphs outside the profile
            logits = model(input_ids=logits[:, -1:].argmax(-1), **passed).logits
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                logits = model(input_ids=logits[:, -1:].argmax(-1), **passed).logits
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    key = "self_device_time_total" if len(activities) > 1 else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[: args.top]
    result = {
        "preset": args.preset, "context": args.context, "device": args.device, "steps": args.steps,
        "self_cpu_ms_per_step": total_us / 1e3 / args.steps,
        "top": [{"op": e.key, "calls_per_step": e.count / args.steps, "ms_per_step": getattr(e, key) / 1e3 / args.steps}
                for e in top],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(prof.key_averages().table(sort_by=key, row_limit=args.top))


if __name__ == "__main__":
    main()
