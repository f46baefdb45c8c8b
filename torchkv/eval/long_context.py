"""Long-context quality through each row's cache: the RULER-style suite and needle-in-a-haystack grids.

Every preset x domain x task x length (suite) or preset x domain x length x depth (needle) is one cell, the domain
naming the held-out text the haystack is cut from. The results JSON is rewritten
after every cell, and a rerun with the same `out` loads the finished cells and runs only the others.

Context, question and target are tokenized separately (no special tokens) and their ids concatenated, so the ids
the cache holds, the ids of the question and the ids scored are the same in generation and in scoring (a joint
tokenization could merge tokens across the boundaries).
"""

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from torchkv.corpora import DEFAULT_DOMAIN, DOMAINS, domain
from torchkv.eval import synthetic
from torchkv.eval.long_report import NEEDLE, SUITE, load
from torchkv.eval.rows import TUNED, Method, method
from torchkv.eval.runner import REFERENCE, _commit, _write, machine
from torchkv.eval.through_cache import Request, generate, score
from torchkv.models.arch import swapped_attention
from torchkv.models.loader import load_model
from torchkv.models.prompt_attention import transformers_sdpa_by_query_blocks
from torchkv.version import __version__

#: new tokens generated for a suite answer: the multi-answer tasks list several words or keys
MAX_NEW_TOKENS = 48
#: calibration tokens of a tuned row (`tuned:ROW@BITS`), as in `torchkv eval`
TUNE_TOKENS = 32768


def _load(model_name: str):
    """(model, tokenizer); tests replace it to reuse a loaded model."""
    return load_model(model_name)


def _ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_grid(presets: Sequence[str], lengths: Sequence[int], samples: int) -> None:
    if not presets:
        raise ValueError("no presets given: pass at least one, e.g. --presets fp16,kivi-2bit")
    if not lengths or any(int(n) <= 0 for n in lengths):
        raise ValueError(f"context lengths must be positive token counts, e.g. 2048,4096; got {list(lengths)}")
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")


def _domains(names: Sequence[str]) -> list[str]:
    """The haystack domains, each checked (an unknown one lists the available ones) before any work."""
    if not names:
        raise ValueError(f"no domain given: pass at least one of {', '.join(DOMAINS)}")
    for name in names:
        domain(name)
    return list(dict.fromkeys(names))


def _rows(presets: Sequence[str]) -> list[Method]:
    """The full-precision reference first, then every other named row (each resolved now, before any work)."""
    return [method(REFERENCE)] + [method(n) for n in dict.fromkeys(presets) if n != REFERENCE]


def _tuning(presets: Sequence[str], tune_domain: str) -> dict:
    """The settings entry of tuned rows' calibration domain (checked now), where the run has tuned rows: results of
    another domain's tuning are not resumed into."""
    domain(tune_domain)
    return {"tune_domain": tune_domain} if any(p.startswith(TUNED) for p in presets) else {}


def _prepare(row: Method, model, tokenizer, model_name: str, out: Path, progress: bool, tune_domain: str) -> None:
    """Tune a tuned row on `tune_domain`; check that the row can build a cache for `model`, saying how to calibrate
    if it must be."""
    if row.tuning is not None:
        row.tune_for(model, tokenizer, TUNE_TOKENS, out.parent, progress, tune_domain)
    try:
        row.new_cache(model)
    except ValueError as err:
        if row.pipeline is None or not row.pipeline.needs_fit:
            raise
        raise ValueError(
            f"preset {row.name!r} must be calibrated on {model_name} first: run `torchkv calibrate --preset "
            f"{row.name} --model {model_name} --out DIR`, then pass DIR as the preset (--presets DIR); {err}"
        ) from err


def _positions(model) -> int:
    return model.config.get_text_config(decoder=True).max_position_embeddings


def _start(kind: str, model_name: str, model, settings: dict, out: Path) -> dict:
    """The results so far: those in `out` when it holds a run of the same kind, model and settings, else new."""
    if out.exists():
        results = load(out)
        meta = results["meta"]
        if (meta["kind"], meta.get("model"), meta.get("settings")) != (kind, model_name, settings):
            raise ValueError(
                f"{out} holds a {meta['kind']} run of {meta.get('model')} with settings {meta.get('settings')}, not a {kind} "
                f"run of {model_name} with {settings}: pass another --out (or delete {out} to start over)"
            )
        return results
    meta = {
        "kind": kind, "model": model_name, "settings": settings, "reference": REFERENCE,
        "dtype": str(model.dtype).removeprefix("torch."), "positions": _positions(model),
        "torchkv": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "commit": _commit(), "machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return {"meta": meta, "cells": []}


def _prompt_attention(model, row: Method) -> contextlib.AbstractContextManager:
    """transformers' own attention for the rows that use it (full precision, quanto), with masked prompts computed
    by query blocks (`transformers_sdpa_by_query_blocks`); torchkv rows compute theirs so already."""
    if row.kind not in ("dynamic", "quanto"):
        return contextlib.nullcontext()
    return swapped_attention(model, "sdpa_by_query_blocks", transformers_sdpa_by_query_blocks)


def _run_cells(
    kind: str, model_name: str, presets: Sequence[str], grid: list[dict], settings: dict, out: Path,
    measure: Callable[[object, object, Method, dict], dict], model, tokenizer, progress: bool,
) -> dict:
    """Run `measure(model, tokenizer, row, cell)` for every row x cell of `grid` (dicts with a 'length') that `out`
    does not hold yet, writing the results after each cell."""
    out = Path(out)
    rows = _rows(presets)
    if model is None:
        model, tokenizer = _load(model_name)
    results = _start(kind, model_name, model, settings, out)
    fields = ("preset", *grid[0])

    def key(cell: dict) -> tuple:
        return tuple(cell[f] for f in fields)

    wanted = [{"preset": row.name, **cell} for row in rows for cell in grid]
    done = {key(c) for c in results["cells"]}
    todo = [cell for cell in wanted if key(cell) not in done]
    limit = _positions(model)
    runs = {cell["preset"] for cell in todo if cell["length"] <= limit}
    for row in rows:  # every row is tuned and checked before the first cell runs
        if row.name in runs:
            _prepare(row, model, tokenizer, model_name, out, progress, settings.get("tune_domain", DEFAULT_DOMAIN))
    by_name = {row.name: row for row in rows}
    told = set()
    with tqdm(total=len(done | {key(c) for c in wanted}), initial=len(done), desc=kind, unit="cell",
              disable=not progress) as bar:
        for cell in todo:
            bar.set_postfix_str(" ".join(str(v) for v in cell.values()))
            if cell["length"] > limit:
                reason = f"{model_name} has {limit} positions; a {cell['length']}-token context does not fit"
                if reason not in told:
                    told.add(reason)
                    tqdm.write(f"skipping: {reason}")
                results["cells"].append({**cell, "skipped": reason})
            else:
                started = time.perf_counter()
                with _prompt_attention(model, by_name[cell["preset"]]):
                    measured = measure(model, tokenizer, by_name[cell["preset"]], cell)
                results["cells"].append({**cell, **measured, "samples": settings["samples"],
                                         "seconds": time.perf_counter() - started})
            _write(out, results)  # an interrupted run keeps every finished cell
            bar.update()
    order = {key(cell): i for i, cell in enumerate(wanted)}
    results["cells"].sort(key=lambda c: order.get(key(c), len(order)))  # cells of an earlier, other grid go last
    _write(out, results)
    return results


def run_suite(
    model_name: str, presets: Sequence[str], tasks: Sequence[str], lengths: Sequence[int], samples: int,
    out: Path, progress: bool = True, model=None, tokenizer=None, domains: Sequence[str] = (DEFAULT_DOMAIN,),
    tune_domain: str = DEFAULT_DOMAIN,
) -> dict:
    """RULER-style tasks through every row's cache; returns (and writes to `out`) the results.

    A cell is {preset, domain, task, length, accuracy, by_seed, samples, seconds}: over seeds 0..samples-1, accuracy
    is the mean recall of the answers in the greedy generation through the row's cache (`synthetic.score`), by_seed
    each seed's recall (every row draws the same samples, so rows compare seed by seed).
    `model`/`tokenizer` reuse a loaded model of `model_name` instead of loading it; `tuned:ROW@BITS` rows are tuned
    on `tune_domain`'s calibration split.
    """
    unknown = [t for t in tasks if t not in synthetic.RULER_TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown tasks {unknown or list(tasks)}; the tasks are: {', '.join(synthetic.RULER_TASKS)}")
    _check_grid(presets, lengths, samples)

    def measure(model, tokenizer, row: Method, cell: dict) -> dict:
        drawn = [synthetic.ruler_sample(cell["task"], tokenizer, cell["length"], seed, cell["domain"])
                 for seed in range(samples)]
        parts = [(_ids(tokenizer, s.context), _ids(tokenizer, s.question), _ids(tokenizer, s.target)) for s in drawn]
        texts = generate(model, tokenizer, row, [c + q for c, q, _ in parts], MAX_NEW_TOKENS, until=["\n"])
        recalls = [synthetic.score(s, text) for s, text in zip(drawn, texts)]
        return {"accuracy": sum(recalls) / samples, "by_seed": recalls}

    grid = [{"domain": d, "task": t, "length": int(n)}
            for d in _domains(domains) for t in dict.fromkeys(tasks) for n in sorted(set(lengths))]
    settings = {"samples": samples, "max_new_tokens": MAX_NEW_TOKENS, **_tuning(presets, tune_domain)}
    return _run_cells(SUITE, model_name, presets, grid, settings, out, measure, model, tokenizer, progress)


def run_needle(
    model_name: str, presets: Sequence[str], lengths: Sequence[int], depths: Sequence[float], samples: int,
    out: Path, progress: bool = True, model=None, tokenizer=None, domains: Sequence[str] = (DEFAULT_DOMAIN,),
    tune_domain: str = DEFAULT_DOMAIN,
) -> dict:
    """Needle-in-a-haystack through every row's cache, scored only; returns (and writes to `out`) the results.

    `depths` are fractions of the context, 0 (start) to 1 (end). A cell is {preset, domain, length, depth, accuracy,
    logprob, by_seed, samples, seconds}: accuracy is the fraction of samples whose answer greedy decoding would
    produce, logprob the mean answer log-probability (nats), by_seed each seed's {found, logprob}.
    `tuned:ROW@BITS` rows are tuned on `tune_domain`.
    """
    bad = [d for d in depths if not 0 <= d <= 1]
    if bad or not depths:
        raise ValueError(f"needle depths are fractions of the context from 0 to 1 (--depths takes percent, "
                         f"0-100); got {list(depths)}")
    _check_grid(presets, lengths, samples)

    def measure(model, tokenizer, row: Method, cell: dict) -> dict:
        drawn = [synthetic.needle_sample(tokenizer, cell["length"], cell["depth"], seed, cell["domain"])
                 for seed in range(samples)]
        requests = [Request(cached=_ids(tokenizer, s.context), asked=_ids(tokenizer, s.question),
                            continuation=_ids(tokenizer, s.target)) for s in drawn]
        scored = score(model, row, requests)
        return {"accuracy": sum(s.greedy for s in scored) / samples,
                "logprob": sum(s.logprob for s in scored) / samples,
                "by_seed": [{"found": s.greedy, "logprob": s.logprob} for s in scored]}

    grid = [{"domain": name, "length": int(n), "depth": float(d)}
            for name in _domains(domains) for n in sorted(set(lengths)) for d in sorted(set(depths))]
    settings = {"samples": samples, **_tuning(presets, tune_domain)}
    return _run_cells(NEEDLE, model_name, presets, grid, settings, out, measure, model, tokenizer, progress)
