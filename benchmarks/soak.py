"""Long-generation soak (issue 22): generate N tokens with a compiled torchkv pipeline and check that memory grows
only with the cache, that the number of compiled graphs is bounded (it stops growing), and that the first tokens
agree with an eager run of the same pipeline.

    .venv/bin/python benchmarks/soak.py                       # SmolLM2, kivi-2bit and frontier-2bit, 8,000 tokens
    .venv/bin/python benchmarks/soak.py --tokens 1000 --presets kivi-2bit

Writes benchmarks/results/soak.json. The checks (`soak`'s report):
  memory: the process's resident memory grows, from the end of warm-up to the end, by at most the cache's growth
      over the same steps plus `slack` bytes (allocator and Python noise); the cache's bytes grow by at most
      (its bytes per token at the end) × tokens, i.e. never faster than the compressed storage itself.
  graphs: torch._dynamo's `unique_graphs` counter does not grow over the last quarter of the tokens, and stays
      within dynamo's 8 graphs per function. (On CPU it grows once after warm-up: Inductor guards its reductions
      on a length of at most 4,096, so decode attention compiles once more when the history passes 4,096 tokens.)
  agreement: the common prefix of the compiled run's tokens and an eager (compile=False) run's, over `check` tokens.
"""

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList

import torchkv
from torchkv.models import cache_argument


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; the peak where that is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class _Probe(LogitsProcessor):
    """Samples (step, cache bytes, RSS, compiled graphs) every `every` generated tokens."""

    def __init__(self, cache, every: int):
        self.cache, self.every, self.step, self.samples = cache, every, 0, []

    def __call__(self, input_ids, scores):
        self.step += 1
        if self.step % self.every == 0 or self.step == 1:
            self.samples.append({"step": self.step, "cache_bytes": self.cache.nbytes(), "rss": rss_bytes(),
                                 "graphs": unique_graphs()})
        return scores


def _agreement(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    return int((a[:n] == b[:n]).long().cumprod(0).sum())


def soak(model, prompt: torch.Tensor, preset: str, tokens: int, *, warmup: int = 256, check: int = 256,
         every: int = 64, slack: int = 64 << 20, **overrides) -> dict:
    """Generate `tokens` tokens greedily after `prompt` ([1, T]) with `preset` compiled; the report of the checks."""
    mask = torch.ones_like(prompt)
    common = {"attention_mask": mask, "do_sample": False, "pad_token_id": 0}  # min_new_tokens: EOS never stops it
    eager = torchkv.KVPipeline.from_preset(preset, compile=False, **overrides)
    with torchkv.patched(model, eager):
        reference = model.generate(prompt, max_new_tokens=check, min_new_tokens=check, **common)[0, prompt.shape[1]:]
    pipe = torchkv.KVPipeline.from_preset(preset, compile=True, **overrides)
    with torchkv.patched(model, pipe):
        cache = torchkv.new_cache(model)
        probe = _Probe(cache, every)
        graphs_before = unique_graphs()
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, logits_processor=LogitsProcessorList([probe]),
                             **common, **cache_argument(model, cache))[0, prompt.shape[1]:]
        seconds = time.perf_counter() - start
    samples = probe.samples
    warm = next(s for s in samples if s["step"] >= min(warmup, samples[-1]["step"]))
    last = samples[-1]
    rss_growth, cache_growth = last["rss"] - warm["rss"], last["cache_bytes"] - warm["cache_bytes"]
    per_token = last["cache_bytes"] / (prompt.shape[1] + len(out))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    report = {
        "preset": preset, "overrides": overrides, "prompt_tokens": prompt.shape[1], "generated": len(out),
        "seconds": seconds, "tokens_per_s": len(out) / seconds,
        "model_bytes": model_bytes, "cache_bytes": last["cache_bytes"], "cache_bytes_per_token": per_token,
        "peak_rss": peak_rss_bytes(), "rss_growth_after_warmup": rss_growth, "cache_growth_after_warmup": cache_growth,
        "graphs_compiled": last["graphs"] - graphs_before, "graphs_at_warmup": warm["graphs"] - graphs_before,
        "graphs_after_warmup": last["graphs"] - warm["graphs"],
        "graphs_in_last_quarter": last["graphs"] - next(x for x in samples if x["step"] >= tokens * 3 // 4)["graphs"],
        "agreeing_tokens": _agreement(out[:check], reference), "checked_tokens": min(check, len(reference)),
        "samples": samples,
    }
    report["memory_ok"] = rss_growth <= cache_growth + slack and cache_growth <= per_token * (last["step"] - warm["step"]) + 1
    report["graphs_ok"] = report["graphs_in_last_quarter"] == 0 and report["graphs_compiled"] <= 8
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--prompt", type=int, default=128)  # + 8,000 within SmolLM2's 8,192 positions
    parser.add_argument("--presets", default="kivi-2bit,frontier-2bit")
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    args = parser.parse_args()
    from torchkv.corpora import documents

    before_model = rss_bytes()  # the process with torch and transformers imported, before the model exists
    model, tokenizer = torchkv.load_model()
    prompt = documents(tokenizer, args.prompt, 1)
    runs = []
    for preset in args.presets.split(","):
        report = soak(model, prompt, preset, args.tokens)
        # the target: peak memory within 5% of the model plus the cache, over what the process held before the model
        report["rss_before_model"] = before_model
        report["peak_over_model_and_cache"] = (
            (report["peak_rss"] - before_model) / (report["model_bytes"] + report["cache_bytes"]))
        print(json.dumps({k: v for k, v in report.items() if k != "samples"}))
        runs.append(report)
        out = {"device": "cpu", "machine": platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "transformers": transformers.__version__,
               "model": "SmolLM2-135M-Instruct", "runs": runs}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))  # after each preset: a long run keeps what it measured


if __name__ == "__main__":
    main()
