"""Where one row's decode step spends its time: torch.profiler over a few decode steps, of SmolLM2 on Wikipedia text
or, with --shape, of a Llama-shaped model with random weights on random tokens (`gpu_decode.py`'s shapes: nothing
is downloaded, so it runs on the GPU machine).

    python benchmarks/profile_decode.py --preset xquant-cl-2bit --context 4096 --out benchmarks/results/decode/profile_xquant-cl-2bit.json
    python benchmarks/profile_decode.py --shape 1b --device cuda --dtype bfloat16 --preset compiled:frontier-2bit --out $OUT/profile.json

A row is what `torchkv.eval.rows.method` builds: a preset (per-layer path) or `compiled:PRESET` (the whole step
compiled over a fixed-capacity cache, CUDA graphs on a GPU). The prompt is fed in chunks of at most 4096 tokens; the
graphs compile in untimed steps (a whole window's worth more for torchkv rows, so that a flush has run). Writes the
operators with the largest self time (CPU, and CUDA on a GPU) per decode step; on the CPU each Inductor kernel is
an operator of its own (`graph_N_cpp_fused_...`), and "## Call CompiledFxGraph ..." is the time of the Python code
that calls them.
"""

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import torchkv
from torchkv.corpora import token_stream
from torchkv.eval.rows import method
from torchkv.eval.speed import _compiled_at_first_call
from torchkv.testing import load_script

gpu_decode = load_script(Path(__file__).with_name("gpu_decode.py"))

#: untimed decode steps before the profiled ones, as `gpu_decode.py --warmup` (a torchkv row runs a chunk more)
WARMUP = 3


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True, help="a row: PRESET or compiled:PRESET")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--shape", choices=sorted(gpu_decode.SHAPES), help="a random-weights Llama shape, not SmolLM2")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.shape:
        model = gpu_decode.build_model(args.shape, device, dtype)
        ids = gpu_decode.random_ids(args.batch, args.context, model.config.vocab_size, device, seed=0)
    else:
        model, tokenizer = torchkv.load_model()
        model.to(device, dtype)
        ids = token_stream(tokenizer, "eval")[None, : args.context].expand(args.batch, -1).to(device)
    row = method(args.preset)
    warm = gpu_decode.untimed_steps(row, WARMUP)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # on the CPU each Inductor kernel a profiler event of its own, not a part of its graph's wrapper call
    kernel_events = torch._inductor.config.patch({"cpp.enable_kernel_profile": device.type == "cpu"})
    with _compiled_at_first_call(row.pipeline), row.active(model), kernel_events:
        cache = row.new_cache(model, max_cache_len=args.context + warm + args.steps)
        forward = row.decode_forward(model)
        logits = gpu_decode.prefill(model, cache, ids, min(args.context, gpu_decode.PREFILL_CHUNK))
        logits = gpu_decode.decode(forward, model, cache, logits, warm)  # compiles outside the profile
        with profile(activities=activities) as prof:
            gpu_decode.decode(forward, model, cache, logits, args.steps)
            gpu_decode.sync(device)
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    key = "self_device_time_total" if len(activities) > 1 else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[: args.top]
    result = {
        "preset": args.preset, "context": args.context, "batch": args.batch, "model": args.shape or "smollm2",
        "device": args.device, "dtype": args.dtype, "steps": args.steps,
        "self_cpu_ms_per_step": total_us / 1e3 / args.steps,
        "self_device_ms_per_step": (sum(getattr(e, key) for e in events) / 1e3 / args.steps
                                    if len(activities) > 1 else None),
        "top": [{"op": e.key, "calls_per_step": e.count / args.steps, "ms_per_step": getattr(e, key) / 1e3 / args.steps}
                for e in top],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(prof.key_averages().table(sort_by=key, row_limit=args.top))
    return result


if __name__ == "__main__":
    main()
