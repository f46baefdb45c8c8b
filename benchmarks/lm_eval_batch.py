"""Seconds of lm-evaluation-harness's offline task list through the `torchkv` model, per preset, at batch 1 and at a
larger batch, and whether the scores agree (row groups hold a padded batch as its requests alone).

    python benchmarks/lm_eval_batch.py --out benchmarks/results/lm_eval_batch.json
"""

import argparse
import os
import time
from pathlib import Path

import torchkv


def _run(preset: str, batch: int, tasks: str, limit: int) -> tuple[float, dict]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from torchkv.eval.lm_eval_model import TorchKVLM

    model = TorchKVLM(preset=preset, batch_size=batch)
    manager = TaskManager(include_path=str(Path(torchkv.__file__).parent / "tasks"), include_defaults=False)
    start = time.perf_counter()
    out = simple_evaluate(model=model, tasks=[tasks], limit=limit, task_manager=manager, log_samples=False)
    seconds = time.perf_counter() - start
    scores = {task: {k: v for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k}
              for task, metrics in out["results"].items()}
    return seconds, scores


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="dynamic,kivi-4bit,kivi-2bit,squat-2bit,frontier-2bit")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tasks", default="torchkv_offline")
    parser.add_argument("--limit", type=int, default=4, help="documents per task")
    parser.add_argument("--out", default="benchmarks/results/lm_eval_batch.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from torchkv.eval.runner import write_benchmark

    rows = []
    print(f"| preset | batch 1, s | batch {args.batch}, s | speed-up | largest score difference |")
    print("|---|---|---|---|---|")
    for preset in args.presets.split(","):
        one_s, one = _run(preset, 1, args.tasks, args.limit)
        many_s, many = _run(preset, args.batch, args.tasks, args.limit)
        differ = max(abs(one[t][m] - many[t][m]) for t in one for m in one[t])
        rows.append({"preset": preset, "batch_1_s": one_s, f"batch_{args.batch}_s": many_s, "speedup": one_s / many_s,
                     "max_score_difference": differ, "scores_batch_1": one, f"scores_batch_{args.batch}": many})
        print(f"| {preset} | {one_s:.0f} | {many_s:.0f} | {one_s / many_s:.2f}x | {differ:.3g} |", flush=True)
    write_benchmark(args.out, "lm-eval-batch", rows, tasks=args.tasks, limit=args.limit, batch=args.batch)


if __name__ == "__main__":
    main()
