"""Generation profile: prefill and decode throughput, cache bytes and peak memory, in one measured run."""

import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

from torchkv import memory
from torchkv.corpora import token_stream
from torchkv.eval.rows import Method, cache_nbytes
from torchkv.models import cache_argument
from torchkv.pipeline import KVPipeline


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so wall-clock timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: untimed decode steps before the timed ones: a graph specialised for this length compiles there
WARM_STEPS = 2


@torch.no_grad()
def _run(
    model, method: Method, ids: torch.Tensor, new_tokens: int, capacity: int
) -> tuple[float, float, float, object]:
    """Prefill `ids` into a fresh cache, then greedy-decode; returns (prefill s, warm-up s, decode s, cache).
    Compiled rows get a cache of `capacity` tokens (the same for every run, so that one graph serves them)."""
    device = ids.device
    cache = method.new_cache(model, max_cache_len=capacity)  # the capacity is ignored by growing caches
    forward = method.decode_forward(model)
    passed = cache_argument(model, cache)
    sync(device)
    t0 = time.perf_counter()
    logits = model(input_ids=ids, **passed, use_cache=True, logits_to_keep=1).logits
    sync(device)
    times = [time.perf_counter()]
    for step in range(WARM_STEPS + new_tokens):
        token = logits[:, -1:].argmax(-1)
        logits = forward(input_ids=token, **passed, use_cache=True).logits
        if step == WARM_STEPS - 1:
            sync(device)
            times.append(time.perf_counter())
    sync(device)
    times.append(time.perf_counter())
    return times[0] - t0, times[1] - times[0], times[2] - times[1], cache


def warm_lengths(method: Method) -> tuple[int, int]:
    """Prompt lengths of the untimed runs (torchkv rows): whole chunks past a window one token short of full, so that
    their first decode step encodes a chunk from the window (a graph of its own), and long enough that each half of
    them already encodes a chunk: a prompt fed in two pieces then compiles the second piece's attention over encoded
    history (a prefill in chunks runs it) for two sizes, size-generic."""
    pipe = method.pipeline
    if pipe is None:
        return 192, 256
    start = pipe.sinks + pipe.residual + pipe.chunk - 1
    chunks = max(2, -(-(start + 2) // pipe.chunk))  # ceil(length / 2) > start
    return start + chunks * pipe.chunk, start + (chunks + 1) * pipe.chunk


@contextlib.contextmanager
def _compiled_at_first_call(pipe: KVPipeline | None) -> Iterator[None]:
    """A throughput measurement times the compiled steady state: `compile="auto"` would run eagerly through the
    untimed warm-up runs (what a fresh process pays first is `benchmarks/cold_start.py`'s measurement)."""
    if pipe is None or pipe.compile != "auto":
        yield
        return
    pipe.compile = True
    try:
        yield
    finally:
        pipe.compile = "auto"


def generation_profile(
    model, tokenizer, method: Method, context: int, new_tokens: int = 32, batch: int = 1, prefill_runs: int = 1
) -> dict:
    """Measure one generation of `new_tokens` after a `context`-token prompt (batch rows of held-out text).

    The prefill time is the median of `prefill_runs` prefills into fresh caches (the last one is the generation's).

    Compilation is excluded: two short runs of other lengths go first, so the timed prefill reuses the
    shape-generic graphs, and `WARM_STEPS` untimed decode steps precede the timed ones (reported apart).
    For torchkv rows the short runs encode 2 and 3 chunks (a graph first traced on a single chunk would be
    specialised to it: dynamo specialises sizes 0 and 1), then one more from the window in their first decode step,
    whatever the sinks and the prompt length leave in the window.
    """
    if prefill_runs < 1:
        raise ValueError(f"prefill_runs={prefill_runs}: time at least one prefill")
    stream = token_stream(tokenizer, "eval")
    if batch * context > stream.numel():
        raise ValueError(f"batch {batch} x context {context} exceeds the {stream.numel()} held-out tokens")
    device = next(model.parameters()).device
    ids = stream[: batch * context].view(batch, context).to(device)
    capacity = context + WARM_STEPS + new_tokens
    with _compiled_at_first_call(method.pipeline), method.active(model):
        for warm in warm_lengths(method):
            _run(model, method, ids[:, :warm], 2, capacity)
        prefills = [_run(model, method, ids, 0, capacity)[0] for _ in range(prefill_runs - 1)]
        start_rss = memory.current_rss()
        resettable = memory.reset_peak()
        last_prefill_s, warm_s, decode_s, cache = _run(model, method, ids, new_tokens, capacity)
        prefill_s = statistics.median([*prefills, last_prefill_s])
        peak = memory.peak_rss()
        result = {
            "context": context,
            "batch": batch,
            "new_tokens": new_tokens,
            "prefill_runs": prefill_runs,
            "prefill_tokens_per_s": batch * context / prefill_s,
            "decode_tokens_per_s": batch * new_tokens / decode_s,
            "warm_steps": WARM_STEPS,
            "warm_decode_seconds": warm_s,
            #: the timed generation end to end (its prefill, warm-up and timed steps): what a short answer costs
            "generation_seconds": last_prefill_s + warm_s + decode_s,
            "whole_step_compiled": method.compiled,
            "cache_bytes": cache_nbytes(cache),
            "peak_rss_bytes": peak,
            "peak_over_start_bytes": peak - start_rss if resettable else None,
        }
        if device.type == "cuda":
            result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        if hasattr(cache, "encoded_bits_per_value"):
            result["bits_per_value"] = cache.encoded_bits_per_value()
    return result
