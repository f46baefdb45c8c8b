"""A padded row against the same request alone: greedy tokens and log-probabilities, per preset.

A left-padded batch of held-out Wikipedia prompts of different lengths generates `--new-tokens` greedy tokens; each
prompt then generates alone. Per row: how many leading tokens match and the largest |Δ log-prob| of any token at any
step. Rows: `DynamicCache` (the model's own batch noise), each preset with its row groups (a padded row held as it
would be alone), measured in the same run: the same preset held as one store over the padded batch (what torchkv
did before row groups), on fixed-capacity caches (`max_cache_len`, one set of buffers per row group), and with the
whole step over them compiled by Inductor (`generate`'s compile config). With `--batch-invariant`, every row runs
with the model's linear layers in fixed blocks of rows (`torchkv.patch(..., batch_invariant=True)`; the `dynamic`
row's too), which removes the model's own batch noise.

    python benchmarks/batch_invariance.py --out benchmarks/results/batch_invariance.json
    python benchmarks/batch_invariance.py --batch-invariant --out benchmarks/results/batch_invariance_blocked.json
"""

import argparse
import contextlib
import time

import torch
from transformers import CompileConfig, DynamicCache

import torchkv
from torchkv.corpora import documents
from torchkv.eval.runner import write_benchmark
from torchkv.models import cache_argument
from torchkv.models.batch_invariant import batch_invariant_linears
from torchkv.models.step import WHOLE_STEP_OPTIONS
from torchkv.models.cache import TorchKVLayer
from torchkv.pipeline import KVPipeline


def _greedy(model, ids, mask, tokens: int, cache=None, **options):
    extra = {} if cache is None else cache_argument(model, cache)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                         pad_token_id=2, return_dict_in_generate=True, output_scores=True, **extra, **options)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1).float().log_softmax(-1)


@contextlib.contextmanager
def _one_store():
    """Row groups off: the padded batch held by one store per layer."""
    split = TorchKVLayer.split_rows
    TorchKVLayer.split_rows = lambda self, pads: None
    try:
        yield
    finally:
        TorchKVLayer.split_rows = split


def _compare(model, rows, tokens: int, dynamic: bool, fixed: bool = False, compiled: bool = False) -> dict:
    """`fixed`: fixed-capacity caches; `compiled`: their whole decode step compiled."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    options = {}
    if compiled:
        # the whole-step options (`compile_decode_step`'s; a patched model adds them to any compile config)
        config = CompileConfig(fullgraph=True, dynamic=False, mode=None, options=WHOLE_STEP_OPTIONS)
        config._compile_all_devices = True  # transformers compiles on GPUs only unless told
        options = {"compile_config": config}

    def cache(length: int):
        if compiled:  # one capacity: the batch's graphs serve the rows alone
            return torchkv.new_cache(model, max_cache_len=width + tokens)
        if fixed:  # a request's own capacity, as `cache_implementation="static"` sizes it (its row group's too)
            return torchkv.new_cache(model, max_cache_len=length + tokens)
        return DynamicCache(config=model.config) if dynamic else None

    start = time.perf_counter()
    batch_tokens, batch_logprobs = _greedy(model, ids, mask, tokens, cache(width), **options)
    seconds = time.perf_counter() - start
    out = []
    for i, r in enumerate(rows):
        alone_tokens, alone_logprobs = _greedy(model, r[None], torch.ones(1, len(r), dtype=torch.long), tokens,
                                                 cache(len(r)), **options)
        differ = (batch_tokens[i] != alone_tokens[0]).nonzero()
        matching = int(differ[0, 0]) if differ.numel() else tokens
        steps = min(matching + 1, tokens)  # log-probs compared up to the first differing token
        a, b = batch_logprobs[i, :steps], alone_logprobs[0, :steps]
        delta = torch.where(a == b, 0.0, (a - b).abs()).amax(-1)  # (two -inf: a token the generation suppresses)
        out.append({"prompt_tokens": len(r), "matching_tokens": matching, "max_abs_dlogprob": float(delta.max()),
                    "median_step_max_abs_dlogprob": float(delta.median())})
    return {"rows": out, "batch_generate_s": seconds}


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1000,650,371,170", help="prompt tokens of the batch's rows")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--presets", default="kivi-2bit,squat-2bit,subkv-2bit,frontier-2bit,svdq-2bit,xquant-2bit",
                        help="presets measured with row groups and as one store (empty: none)")
    parser.add_argument("--fixed", default="kivi-2bit,frontier-2bit",
                        help="presets also measured on fixed-capacity caches (max_cache_len)")
    parser.add_argument("--compiled", default="kivi-2bit",
                        help="presets also measured with the whole step over fixed-capacity caches compiled")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--batch-invariant", action="store_true", help="linear layers in fixed blocks of rows")
    parser.add_argument("--out", default="benchmarks/results/batch_invariance.json")
    args = parser.parse_args(argv)
    model, tokenizer = torchkv.load_model()
    model = model.to(getattr(torch, args.dtype))
    lengths = [int(n) for n in args.lengths.split(",")]
    ids = documents(tokenizer, max(lengths), len(lengths))
    rows = [ids[i, :n] for i, n in enumerate(lengths)]
    invariant = args.batch_invariant
    with batch_invariant_linears(model) if invariant else contextlib.nullcontext():
        results = [{"row": "dynamic", **_compare(model, rows, args.new_tokens, dynamic=True)}]
    grouped, fixed, compiled = ({n for n in names.split(",") if n} for names in (args.presets, args.fixed, args.compiled))
    for name in dict.fromkeys(n for names in (args.presets, args.fixed, args.compiled) for n in names.split(",") if n):
        pipe = KVPipeline.from_preset(name, compile=False)
        with torchkv.patched(model, pipe, batch_invariant=invariant):
            if name in grouped:
                results.append({"row": name, **_compare(model, rows, args.new_tokens, dynamic=False)})
                with _one_store():
                    results.append({"row": f"{name} (one store)", **_compare(model, rows, args.new_tokens, False)})
            if name in fixed:
                results.append({"row": f"{name} (fixed capacity)", **_compare(model, rows, args.new_tokens, False, True)})
            if name in compiled:
                results.append({"row": f"{name} (whole step compiled)",
                                **_compare(model, rows, args.new_tokens, False, compiled=True)})
    print(f"| row | {' | '.join(f'{n} tokens: matching, max abs dlogprob' for n in lengths)} | batch generate s |")
    print("|---" * (len(lengths) + 2) + "|")
    for r in results:
        cells = [f"{c['matching_tokens']}/{args.new_tokens}, {c['max_abs_dlogprob']:.1e}" for c in r["rows"]]
        print(f"| {r['row']} | {' | '.join(cells)} | {r['batch_generate_s']:.1f} |")
    write_benchmark(args.out, "batch-invariance", results, lengths=lengths, new_tokens=args.new_tokens,
                    dtype=args.dtype, batch_invariant=invariant)


if __name__ == "__main__":
    main()
