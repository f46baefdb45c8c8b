"""`torchkv eval`: every row measured on the same model in one run, written to JSON row by row."""

import dataclasses
import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from torchkv._compat import config_head_dim
from torchkv.corpora import DEFAULT_DOMAIN, DOMAINS, SPLITS, documents, domain
from torchkv.eval.perplexity import perplexity
from torchkv.eval.retrieval import cases, retrieval
from torchkv.eval.rows import Method, method
from torchkv.eval.speed import generation_profile
from torchkv.models.arch import full_layers
from torchkv.models.loader import load_model
from torchkv.version import __version__

REFERENCE = "dynamic"


@dataclass(frozen=True)
class EvalSettings:
    """Sample sizes. Defaults: DESIGN §7 (2 x 2,048-token documents and one of 8,192, 64-token blocks)."""

    ppl_docs: dict[int, int] = dataclasses.field(default_factory=lambda: {2048: 2, 8192: 1})
    block: int = 64
    #: fraction of each perplexity document fed first as one prompt; then only later tokens are scored
    ppl_prompt: float = 0.0
    simulated: bool = False
    retrieval_contexts: tuple[int, ...] = (2048, 4096)
    retrieval_cases: int = 50
    speed_contexts: tuple[int, ...] = (4096,)
    new_tokens: int = 32
    seed: int = 0
    split: str = "eval"
    #: calibration tokens a tuned row (`tuned:ROW@BITS`) measures its sensitivities on
    tune_tokens: int = 32768
    #: text domains (`torchkv.corpora.DOMAINS`) perplexity and retrieval are measured on, each on its own
    domains: tuple[str, ...] = (DEFAULT_DOMAIN,)
    #: the domain whose calibration split a tuned row is tuned on
    tune_domain: str = DEFAULT_DOMAIN

    def __post_init__(self):
        for name in (*self.domains, self.tune_domain):
            domain(name)  # an unknown name lists the available ones
        if self.split != "eval":
            raise ValueError(
                f"evaluation runs on the held-out 'eval' split only; '{self.split}' is "
                f"{'the calibration split, used to fit pipelines' if self.split == 'calibration' else 'unknown'}"
                f" (splits: {', '.join(SPLITS)})"
            )

    def contexts(self) -> list[int]:
        return sorted({*self.ppl_docs, *self.retrieval_contexts, *self.speed_contexts})


def context_key(domain_name: str, tokens: int) -> str:
    """The key of a context's results (perplexity, retrieval): "2048" on the default domain, "code/2048" on others."""
    return str(tokens) if domain_name == DEFAULT_DOMAIN else f"{domain_name}/{tokens}"


#: `make run`: perplexity on every domain at 2K, pass keys at 1K; speed at 1K and at 8K, where the cache's work is
#: most of a DynamicCache decode step on SmolLM2 (its tokens/s halve from 2K to 8K)
QUICK = EvalSettings(ppl_docs={2048: 1}, retrieval_contexts=(1024,), retrieval_cases=10, speed_contexts=(1024, 8192),
                     new_tokens=16, tune_tokens=4096, domains=tuple(DOMAINS))


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_benchmark(path: str | Path, kind: str, rows: list[dict], **settings) -> None:
    """A benchmark's JSON: its rows, and a meta block with its kind and settings, the versions and the machine."""
    meta = {"kind": kind, "model": "smollm2-135m", **settings, "torch": torch.__version__,
            "torchkv": __version__, "machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _write(Path(path), {"meta": meta, "rows": rows})
    print(f"wrote {path}")


def _write(path: Path | None, results: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2))
        tmp.replace(path)


def evaluate_row(model, tokenizer, row: Method, settings: EvalSettings, scored: dict, progress: bool) -> dict:
    """Measure one row; `scored` holds its retrieval results by context key (measured for all rows at once)."""
    config = model.config
    head_dim = config_head_dim(config)
    out: dict = {"name": row.name, "kind": row.kind, "config": row.config()}
    if row.tune_report is not None:
        out["tuning"] = row.tune_report
    if row.pipeline is not None:
        pipe = row.pipeline.for_model(model)
        out["bits_per_value"] = dataclasses.asdict(pipe.bits_per_value(config.num_key_value_heads, head_dim,
                                                                       layers=config.num_hidden_layers))
        if full := full_layers(model):  # what the cache's bits per value tend to beyond the sliding window
            out["full_layer_bits_per_value"] = dataclasses.asdict(pipe.bits_per_value(config.num_key_value_heads,
                                                                                      head_dim, layers=full))
    started = time.perf_counter()
    modes = ["streaming"] + (["simulated"] if settings.simulated and row.kind == "torchkv" else [])
    out["ppl"] = {
        mode: {context_key(name, length): perplexity(
                   model, documents(tokenizer, length, count, domain_name=name), row, settings.block,
                   simulated=mode == "simulated", progress=progress, prompt=int(settings.ppl_prompt * length))
               for name in settings.domains for length, count in sorted(settings.ppl_docs.items())}
        for mode in modes
    }
    out["retrieval"] = {key: by_row[row.name] for key, by_row in scored.items()}
    out["generation"] = [generation_profile(model, tokenizer, row, c, settings.new_tokens)
                         for c in settings.speed_contexts]
    out["seconds"] = time.perf_counter() - started
    return out


def run_eval(
    model_name: str,
    names: list[str],
    settings: EvalSettings = EvalSettings(),
    out: Path | None = None,
    progress: bool = True,
) -> dict:
    """Evaluate the full-precision reference and every named row; return (and write) the results."""
    rows = [method(REFERENCE)] + [method(n) for n in names if n != REFERENCE]  # resolves every name first
    model, tokenizer = load_model(model_name)
    limit = model.config.max_position_embeddings
    if max(settings.contexts()) > limit:
        raise ValueError(f"context {max(settings.contexts())} exceeds {model_name}'s limit of {limit} positions")
    torch.manual_seed(settings.seed)
    case_sets = {context_key(name, c): cases(tokenizer, c, settings.retrieval_cases, settings.seed, name)
                 for name in settings.domains for c in settings.retrieval_contexts}
    results = {
        "meta": {
            "torchkv": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "commit": _commit(), "model": model_name, "dtype": str(model.dtype).removeprefix("torch."),
            "values_per_token": 2 * model.config.num_hidden_layers * model.config.num_key_value_heads
            * config_head_dim(model.config),
            "machine": machine(), "settings": dataclasses.asdict(settings), "reference": REFERENCE,
            "domains": {name: domain(name).description for name in settings.domains},
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "rows": [],
    }
    for row in rows:
        if row.tuning is not None:
            row.tune_for(model, tokenizer, settings.tune_tokens, None if out is None else Path(out).parent, progress,
                         settings.tune_domain)
    scored = {key: retrieval(model, case_set, rows, progress) for key, case_set in case_sets.items()}
    for row in rows:
        results["rows"].append(evaluate_row(model, tokenizer, row, settings, scored, progress))
        _write(out, results)  # an interrupted run keeps the rows already finished
    return results
