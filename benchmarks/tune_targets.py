"""Tuned against uniform at the same stored bits: the ratio of perplexity increases, from `torchkv eval` results.

    python benchmarks/tune_targets.py benchmarks/results/tune/eval_smollm2.json \\
        benchmarks/results/tune/eval_smollm2_prompt.json --decode benchmarks/results/tune/decode_cpu.json \\
        --out benchmarks/results/tune/targets.md
    python benchmarks/tune_targets.py benchmarks/results/tune/gemma3/eval_gemma3.json \\
        --out benchmarks/results/tune/gemma3/targets.md

Pairs are (tuned row, uniform row) names; a row given as a folder is matched by the folder's last part. Decode
speeds come from `benchmarks/decode.py` results (`--decode`: each row in a fresh process, as a ratio to the
DynamicCache measured beside it), else from the eval's generation profile.
"""

import argparse
import json
from pathlib import Path

PAIRS = (("tuned:kivi-2bit@2.5", "kivi-2bit:group=64"), ("tuned:kivi-2bit@3", "kivi-2bit"),
         ("tuned:frontier-2bit@2.125", "frontier-2bit"), ("tuned:frontier-2bit@2.5", "frontier-2.5bit"))


def _short(name: str) -> str:
    return "tuned:" + Path(name).name if "/" in name else name


def rows(results: dict) -> dict[str, dict]:
    return {_short(r["name"]): r for r in results["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--decode", help="benchmarks/decode.py results of the same rows")
    parser.add_argument("--out")
    args = parser.parse_args()
    decode = rows(json.loads(Path(args.decode).read_text())) if args.decode else {}
    lines = ["| mode | context | tuned | bits | ppl increase | uniform | bits | ppl increase | ratio (target ≤ 0.7) | "
             "decode tuned / uniform (target ≥ 0.9) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for path in args.results:
        results = json.loads(Path(path).read_text())
        by_name = rows(results)
        ref = by_name[results["meta"]["reference"]]
        mode = "prompt" if results["meta"]["settings"]["ppl_prompt"] else "streaming"
        for tuned_name, uniform_name in PAIRS:
            tuned, uniform = by_name.get(tuned_name), by_name.get(uniform_name)
            if tuned is None or uniform is None:
                continue
            for ctx, ref_ppl in ref["ppl"]["streaming"].items():
                inc = [100 * (r["ppl"]["streaming"][ctx] / ref_ppl - 1) for r in (tuned, uniform)]
                bits = [(r["bits_per_value"]["keys"] + r["bits_per_value"]["values"]) / 2 for r in (tuned, uniform)]
                speed = "–"
                if tuned_name in decode and uniform_name in decode:
                    speed = f"{decode[tuned_name]['decode_ratio'] / decode[uniform_name]['decode_ratio']:.2f}x"
                elif tuned.get("generation") and uniform.get("generation"):
                    ratio = tuned["generation"][0]["decode_tokens_per_s"] / uniform["generation"][0]["decode_tokens_per_s"]
                    speed = f"{ratio:.2f}x"
                lines.append(f"| {mode} | {ctx} | {tuned_name} | {bits[0]:.3f} | {inc[0]:+.2f}% | {uniform_name} | "
                             f"{bits[1]:.3f} | {inc[1]:+.2f}% | {inc[0] / inc[1]:.2f} | {speed} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
