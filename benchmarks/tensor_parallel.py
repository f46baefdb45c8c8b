"""Greedy generation through torchkv's cache on a tensor-parallel model (transformers' `tp_plan="auto"`, CPU,
gloo) against the same model on one device.

Every rank loads the model sharded over the ranks (each holds `H / tp` KV heads and compresses only those),
generates greedily after a held-out Wikipedia prompt (random token ids for a model folder without a tokenizer)
with each preset, and reports its tokens and its cache bytes. Rank 0 then generates with the unsharded model
and writes, per preset: whether the tokens equal one device's, the first differing position, the tokens
compared, and each side's leading tokens equal to full precision (no torchkv) on that side. A preset refused
under tensor parallelism is recorded with its error.

    torchrun --standalone --nproc-per-node 3 benchmarks/tensor_parallel.py --out benchmarks/results/tensor_parallel.json
"""

import argparse
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

import torchkv
from torchkv.corpora import documents
from torchkv.eval.runner import write_benchmark
from torchkv.models.loader import model_path

PRESETS = ("kivi-4bit,squat-2bit,subkv-2bit,frontier-2bit,aquakv-2bit-nopred,svdq-2bit-v4,svdq-1.25bit,"
           "xquant-2bit,aquakv-2bit")
FULL_PRECISION = "full-precision"  # the row of the unpatched model


def prompt_ids(path: Path, tokens: int, vocab: int) -> torch.Tensor:
    """[1, tokens] ids: held-out Wikipedia text for a model with a tokenizer, else seeded random ids."""
    if (path / "tokenizer_config.json").is_file():
        return documents(AutoTokenizer.from_pretrained(path, local_files_only=True), tokens, 1)
    return torch.randint(vocab, (1, tokens), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def generate(model, name: str, prompt: torch.Tensor, new_tokens: int) -> dict:
    """{"tokens": the `new_tokens` greedy tokens, "logits": their logits [new_tokens, vocab], "cache_bytes",
    "warnings"} with preset `name` (or no torchkv for `FULL_PRECISION`), or {"error": ...} when torchkv refuses
    the preset for this model."""
    settings = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
                "return_dict_in_generate": True, "output_logits": True}
    if name == FULL_PRECISION:
        out = model.generate(prompt, **settings)
        return {"tokens": out.sequences[0, prompt.shape[1]:].tolist(), "logits": torch.cat(out.logits)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torchkv.patched(model, name):
                out = model.generate(prompt, **settings)
        except NotImplementedError as err:
            return {"error": str(err)}
    mine = [str(w.message) for w in caught if "tensor-parallel" in str(w.message)]
    return {"tokens": out.sequences[0, prompt.shape[1]:].tolist(), "logits": torch.cat(out.logits),
            "cache_bytes": out.past_key_values.nbytes(), "warnings": sorted(set(mine))}


def leading_equal(a: list[int], b: list[int]) -> int:
    """Leading positions where `a` and `b` agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(tp: dict, one: dict | None, tp_full: list[int], one_full: list[int]) -> dict:
    """One preset's row from its tensor-parallel result (rank 0's, with every rank's cache bytes) and its
    one-device result (None where tensor parallelism refused it)."""
    if "error" in tp:
        return {"status": "refused", "error": tp["error"]}
    first = leading_equal(tp["tokens"], one["tokens"])
    same_prefix = slice(0, first + 1)  # steps whose inputs are still the same on both sides
    row = {"status": "ok", "equal": tp["tokens"] == one["tokens"],
           "logits_max_difference": float((tp["logits"][same_prefix] - one["logits"][same_prefix]).abs().max()),
           "first_difference": None if tp["tokens"] == one["tokens"] else first, "compared": len(one["tokens"]),
           "tp_equal_full_precision": leading_equal(tp["tokens"], tp_full),
           "one_device_equal_full_precision": leading_equal(one["tokens"], one_full),
           "tokens": tp["tokens"], "one_device_tokens": one["tokens"]}
    if "cache_bytes" in tp:
        row.update(cache_bytes_per_rank=tp["cache_bytes"], cache_bytes_one_device=one["cache_bytes"],
                   warnings=tp["warnings"])
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a known model name or a saved model folder")
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--prompt", type=int, default=192, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel.json")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the one-device run: write only the tensor-parallel results (rows 'tp')")
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True, distributed_config=DistributedConfig(tp_plan="auto"))
    prompt = prompt_ids(path, args.prompt, model.config.vocab_size)
    names = [FULL_PRECISION, *args.presets.split(",")]
    tp = {name: generate(model, name, prompt, args.new_tokens) for name in names}
    ranks = [None] * world
    # tokens and bytes only: each rank's cache stays where it is
    dist.all_gather_object(ranks, {n: {k: v for k, v in r.items() if k != "logits"} for n, r in tp.items()})
    if rank == 0:
        for name in names:
            if any(r[name].get("tokens") != tp[name].get("tokens") for r in ranks):
                raise RuntimeError(f"{name}: the ranks generated different tokens: {[r[name] for r in ranks]}")
            if "cache_bytes" in tp[name]:
                tp[name]["cache_bytes"] = [r[name]["cache_bytes"] for r in ranks]
        settings = {"model": args.model, "tp_size": model.tp_size, "backend": "gloo", "prompt": args.prompt,
                    "new_tokens": args.new_tokens}
        if args.no_reference:
            rows = [{"preset": n, "tp": {k: v for k, v in tp[n].items() if k != "logits"}} for n in names]
            write_benchmark(args.out, "tensor_parallel", rows, **settings)
        else:
            single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
            one = {n: generate(single, n, prompt, args.new_tokens) for n in names if "error" not in tp[n]}
            full = (tp[FULL_PRECISION]["tokens"], one[FULL_PRECISION]["tokens"])
            rows = [{"preset": n, **compare(tp[n], one.get(n), *full)} for n in names]
            for row in rows:
                summary = row.get("error") or (
                    f"equal={row['equal']} first_difference={row['first_difference']} of {row['compared']}, "
                    f"logits max |diff| {row['logits_max_difference']:.2e}")
                print(f"{row['preset']}: {summary}", flush=True)
            write_benchmark(args.out, "tensor_parallel", rows, **settings)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
