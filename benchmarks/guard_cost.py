"""What dynamo's guards cost a compiled decode-attention call, timed without the profiler.

`profile_decode.py` reports "TorchDynamo Cache Lookup" among a row's largest costs (frontier-2bit at 4K on 2 CPU
cores: 0.26-0.33 ms per call, 8.6% of the step). This script runs the same row over SmolLM2 on Wikipedia text, keeps
the arguments of one layer's compiled `attend`, and times, outside any profiler, the guard check of each graph
dynamo holds for it and the whole compiled call.

    python benchmarks/guard_cost.py --preset frontier-2bit --context 4096 --out benchmarks/results/decode/guard_cost_frontier-2bit.json
"""

import argparse
import inspect
import json
from pathlib import Path

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import torchkv
from torchkv.corpora import token_stream
from torchkv.eval.rows import method
from torchkv.eval.speed import _compiled_at_first_call
from torchkv.pipeline.codec import Codec
from torchkv.testing import load_script

CPU = torch.device("cpu")
gpu_decode = load_script(Path(__file__).with_name("gpu_decode.py"))
decode_benchmark = load_script(Path(__file__).with_name("decode.py"))


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="frontier-2bit", help="a per-layer row (a preset)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=40, help="decode steps before the timing (compiles in them)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    kept = {}
    run = Codec.run

    def keeping(codec, fn, *call):
        if fn.__name__ == "attend" and not torch.compiler.is_compiling():
            kept.update(codec=codec, call=call)
        return run(codec, fn, *call)

    Codec.run = keeping
    try:
        model, tokenizer = torchkv.load_model()
        ids = token_stream(tokenizer, "eval")[None, : args.context]
        row = method(args.preset)
        with _compiled_at_first_call(row.pipeline), row.active(model):
            cache = row.new_cache(model, max_cache_len=args.context + args.steps + 64)
            forward = row.decode_forward(model)
            logits = gpu_decode.prefill(model, cache, ids, min(args.context, gpu_decode.PREFILL_CHUNK))
            gpu_decode.decode(forward, model, cache, logits, args.steps)
    finally:
        Codec.run = run
    codec, call = kept["codec"], kept["call"]
    compiled = codec.compiled["attend"]
    bound = compiled._torchdynamo_orig_callable
    frame = dict(inspect.signature(bound.__func__).bind(codec, *call).arguments)
    entries = _debug_get_cache_entry_list(bound.__func__.__code__)
    result = {
        "preset": args.preset, "context": args.context, "model": "smollm2", "torch": torch.__version__,
        "graphs": len(entries),
        "guard_check_us": [1e6 * decode_benchmark._timed(lambda e=e: e.guard_manager.check(frame), 200, CPU)
                           for e in entries],
        "passing_graph": next(i for i, e in enumerate(entries) if e.guard_manager.check(frame)),
        "compiled_call_us": 1e6 * decode_benchmark._timed(lambda: compiled(*call), 50, CPU),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
