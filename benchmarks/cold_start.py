"""Cold start: what a fresh process's first `generate` costs, Inductor's on-disk caches cold and warm.

Each row runs twice, each time in a fresh process: SmolLM2 fp32 loads (not timed), then
`generate(max_new_tokens=64)` after a 1,024-token prompt is timed: `first_s` (tracing, compiling, prefill,
decode), then the same call again in the same process (`second_s`, nothing left to compile), then one generation of
`--later-tokens` more (not for whole-step rows: their graphs are per capacity, and a longer generation has other
buffers), and the graphs compiled after the first call are counted (`graphs_after_first`).
"cold" gives the process a fresh, empty TORCHINDUCTOR_CACHE_DIR; "warm" the one the cold process filled.

Rows: transformers' DynamicCache and QuantizedCache (quanto) and torchkv presets as `torchkv.patch` leaves them
(`compile="auto"`); `--compile-first` presets again with `compile=True` (rows `PRESET compile=True`); and the whole
decode step compiled through generate (`cache_implementation="static"` with a compile config): transformers'
StaticCache (`static-compiled`) and torchkv's fixed-capacity cache (`compiled:PRESET`).

    python benchmarks/cold_start.py --out benchmarks/results/whole_step/cold_start_cpu.json
    python benchmarks/cold_start.py --rows dynamic,frontier-2.5bit --compile-first '' --append --out ...  # remeasure
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIRST_CALL = " compile=True"


def child(row: str, prompt_tokens: int, new_tokens: int, later_tokens: int) -> dict:
    """One row's timings in this (fresh) process."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    import torchkv
    from torchkv.corpora import documents
    from torchkv.eval.rows import method
    from torchkv.models import cache_argument

    model, tokenizer = torchkv.load_model()
    ids = documents(tokenizer, prompt_tokens, 1)
    name, compile_first = row.removesuffix(FIRST_CALL), row.endswith(FIRST_CALL)
    m = method(name)
    kwargs = {}
    if m.compiled:
        config = CompileConfig(fullgraph=True, dynamic=False)
        config._compile_all_devices = True  # transformers compiles only on GPUs unless told
        kwargs = {"cache_implementation": "static", "compile_config": config}
    baseline_cache = m.pipeline is None and not m.compiled  # DynamicCache or QuantizedCache, fresh per call
    if m.pipeline is not None:
        if compile_first:
            m.pipeline.compile = True
        torchkv.patch(model, m.pipeline)

    def generate(tokens: int) -> float:
        passed = {**kwargs, **cache_argument(model, m.new_cache(model))} if baseline_cache else kwargs
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **passed)
        assert out.shape[1] == prompt_tokens + tokens
        return time.perf_counter() - start

    first = generate(new_tokens)
    graphs_first = counters["stats"]["unique_graphs"]
    result = {"first_s": first, "second_s": generate(new_tokens), "graphs_first": graphs_first}
    if not m.compiled:  # whole-step graphs are per capacity: a longer generation is other buffers
        result["later_s"] = generate(later_tokens)
    result["graphs_after_first"] = counters["stats"]["unique_graphs"] - graphs_first
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="dynamic,quanto-2bit,kivi-2bit,squat-2bit,frontier-2.5bit,static-compiled,"
                                          "compiled:kivi-2bit")
    parser.add_argument("--compile-first", default="kivi-2bit,frontier-2.5bit", help="presets also run with compile=True")
    parser.add_argument("--modes", default="cold,warm")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--later-tokens", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results/whole_step/cold_start_cpu.json")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows of the JSON at --out, replacing those this run measures again")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.prompt_tokens, args.new_tokens, args.later_tokens)))
        return

    import torch

    import torchkv
    from torchkv.eval.runner import machine

    rows = [r for r in args.rows.split(",") if r] + [p + FIRST_CALL for p in args.compile_first.split(",") if p]
    results = {"meta": {"kind": "cold-start-benchmark", "model": "smollm2-135m", "dtype": "float32",
                        "torchkv": torchkv.__version__, "torch": torch.__version__, "machine": machine(),
                        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                        "later_tokens": args.later_tokens,
                        "runs": [{"started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                  "argv": argv if argv is not None else sys.argv[1:]}]},
               "rows": []}
    out = Path(args.out)
    if args.append and out.is_file():
        kept = json.loads(out.read_text())
        results["meta"]["runs"] = kept["meta"]["runs"] + results["meta"]["runs"]
        results["rows"] = [r for r in kept["rows"] if r["row"] not in rows]
    with tempfile.TemporaryDirectory() as scratch:
        for i, row in enumerate(rows):
            cache_dir = Path(scratch) / f"inductor-{i}"  # cold at the row's first mode
            for mode in args.modes.split(","):
                command = [sys.executable, __file__, "--child", row, "--prompt-tokens", str(args.prompt_tokens),
                           "--new-tokens", str(args.new_tokens), "--later-tokens", str(args.later_tokens)]
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"row {row!r} ({mode}) failed:\n{done.stderr[-4000:]}")
                result = {"row": row, "mode": mode, **json.loads(done.stdout.strip().splitlines()[-1])}
                results["rows"].append(result)
                print(json.dumps(result), flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(results, indent=2))
    print(table(results))
    print(f"wrote {out}")


def table(results: dict) -> str:
    """Markdown: first-call seconds per row and mode, with its ratio to DynamicCache's and seconds over it."""
    rows, modes = {}, []
    for r in results["rows"]:
        rows.setdefault(r["row"], {})[r["mode"]] = r
        modes += [r["mode"]] if r["mode"] not in modes else []
    reference = rows.get("dynamic", {})
    head = [f"{mode} first call s (x dynamic, + s)" for mode in modes]
    lines = ["| row | " + " | ".join(head) + " | same call again s | graphs compiled in the first call / after it |",
             "|---|" + "---|" * (len(modes) + 2)]
    for name in sorted(rows, key=lambda n: n != "dynamic"):  # the reference first, then as measured
        by_mode, cells = rows[name], []
        for mode in modes:
            r, ref = by_mode.get(mode), reference.get(mode)
            if r is None:
                cells.append("–")
            elif ref is None:
                cells.append(f"{r['first_s']:.1f}")
            else:
                cells.append(f"{r['first_s']:.1f} ({r['first_s'] / ref['first_s']:.2f}x, "
                             f"{r['first_s'] - ref['first_s']:+.1f})")
        last = by_mode[modes[-1]]
        lines.append(f"| {name} | " + " | ".join(cells) +
                     f" | {last['second_s']:.1f} | {last['graphs_first']} / {last['graphs_after_first']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
