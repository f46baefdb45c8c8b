"""Evaluate presets against full precision and transformers' QuantizedCache from Python; write JSON and a report."""

import argparse
from pathlib import Path

from torchkv.eval.report import markdown_table, plots
from torchkv.eval.runner import EvalSettings, run_eval


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", default="kivi-4bit,kivi-2bit")
    parser.add_argument("--context", type=int, default=2048, help="perplexity, retrieval and speed context")
    parser.add_argument("--cases", type=int, default=10, help="retrieval cases")
    parser.add_argument("--out", default="out/evaluate.json")
    parser.add_argument("--no-baselines", action="store_true")
    args = parser.parse_args(argv)

    settings = EvalSettings(
        ppl_docs={args.context: 1},
        retrieval_contexts=(args.context,),
        retrieval_cases=args.cases,
        speed_contexts=(args.context,),
        new_tokens=8,
    )
    names = args.presets.split(",") + ([] if args.no_baselines else ["quanto-4bit", "quanto-2bit"])
    out = Path(args.out)
    results = run_eval("smollm2-135m", names, settings, out, progress=False)
    print(markdown_table(results))
    for path in plots(results, out.parent, out.stem):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
