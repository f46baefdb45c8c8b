"""GPU decode benchmark: milliseconds per decode step of Llama-shaped models (random bf16 weights) for transformers'
caches and torchkv's, against transformers' StaticCache under CUDA graphs and the fp16 bandwidth limit.

    python benchmarks/gpu_decode.py                                   # the default cells and rows, on cuda
    python benchmarks/gpu_decode.py --cells 1b:1x4096 --rows dynamic,kivi-2bit
    python benchmarks/gpu_decode.py --device cpu --dtype float32 --cells tiny:1x96 --rows dynamic,kivi-2bit

A cell is SHAPE:BATCHxCONTEXT. Rows: `dynamic` (DynamicCache, eager), `static-compiled` (StaticCache, the whole step
compiled, CUDA graphs on a GPU), a torchkv preset (per-layer path) and `compiled:PRESET` (the whole step compiled
over a fixed-capacity torchkv cache), as `torchkv.eval.rows.method` builds them; `tuned` and `compiled:tuned` are
the widths of the folder `--tuned` (tuned on SmolLM2, per layer or per KV head) placed on the cell's shape
(`on_shape`). Each row fills a cache with a prompt in chunks of at most 4096 tokens twice (timed: its first prefill
at that size, then the steady one; a torchkv row's later chunks attend the compressed history, as in chunked
serving), runs --warmup untimed steps on the second (where compiled rows compile; torchkv rows one chunk of steps
more) and --steps timed ones. Every run writes its own DIR/gpu_decode_<device>_<timestamp>.{json,md,png}; the JSON
and the Markdown are rewritten after every row, so a run cut short keeps what it measured. Rows not started by
--deadline-seconds are recorded as skipped.
"""

import argparse
import gc
import inspect
import json
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig

import torchkv
from torchkv.eval.decode_report import _table
from torchkv.eval.rows import COMPILED, STATIC_BASELINE, Method, cache_nbytes, method
from torchkv.eval.runner import _write, machine
from torchkv.eval.speed import WARM_STEPS, _compiled_at_first_call, sync, warm_lengths
from torchkv.models import arch, cache_argument
from torchkv.ops import triton_decode
from torchkv.pipeline.io import layer_specs
from torchkv.testing import load_script

_decode_benchmark = load_script(Path(__file__).with_name("decode.py"))
copy_bandwidth, kernel_row = _decode_benchmark.copy_bandwidth, _decode_benchmark.kernel_row

#: LlamaConfig arguments of each shape: Llama 3.2 1B, Llama 3.1 8B, and a tiny one for tests on the CPU
SHAPES = {
    "1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True),
    "8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=False),
    "tiny": dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=256, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True),
}
RANDOM_WEIGHTS = (
    "Weights are random (LlamaConfig and random initialisation; nothing is downloaded) and prompts are random token "
    "ids. A decode step's time depends on the shapes and the bytes it reads, not on the values in them: the same "
    "matrix products and cache reads run whatever the weights are, so these timings are those of trained models of "
    "these shapes."
)
FP16_LIMIT = "fp16 at bandwidth"
#: tokens (batch x chunk length) of one prefill forward pass, and the longest chunk
PREFILL_TOKENS, PREFILL_CHUNK = 32768, 4096
#: bytes of one key or value element in the fp16 limit
FP16_BYTES = 2
GB = 1e9


#: the row of a tuned folder's widths on the benchmark's shape (`on_shape`); `compiled:tuned` decodes it whole-step
TUNED_ROW = "tuned"
#: the folder `--tuned` reads by default: `torchkv tune --preset frontier-2bit --budget 2.5 --domain mixed --per-head`
#: on SmolLM2 (the recipe the README recommends)
TUNED_FOLDER = Path(__file__).parent / "results/domains/ablations/tuned/frontier-2bit@2.5_mixed_per_head_far"


def parse_cells(text: str) -> list[tuple[str, int, int]]:
    """`1b:1x4096,8b:8x32768` -> [(shape, batch, context), ...]."""
    cells = []
    for cell in filter(None, text.split(",")):
        shape, _, size = cell.partition(":")
        batch, _, context = size.partition("x")
        if shape not in SHAPES or not batch.isdigit() or not context.isdigit():
            raise ValueError(f"cell {cell!r}: expected SHAPE:BATCHxCONTEXT with SHAPE in {sorted(SHAPES)}")
        cells.append((shape, int(batch), int(context)))
    return cells


def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    """A randomly initialised LlamaForCausalLM of `shape` (`from_config`: no hub), made on `device` in `dtype`, so
    that no fp32 copy of the 8B model is initialised on the host first."""
    config = LlamaConfig(**SHAPES[shape], use_cache=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def tuned_config(folder: Path) -> dict:
    """The saved config of the tuned pipeline in `folder`; a clear error where there is none."""
    path = folder / "torchkv_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if config.get("tuned_for") is None:
        raise ValueError(f"--tuned {folder}: no pipeline tuned for a model is saved there; give a folder written by "
                         "`torchkv tune ... --out DIR`")
    return config


def on_shape(folder: Path, model) -> torchkv.KVPipeline:
    """The pipeline saved in `folder` (tuned per layer or per KV head, for another model) with its widths placed on
    `model`'s layers and KV heads: layer i of L takes the folder's layer round(i·(L₀-1)/(L-1)) of L₀, and KV head h
    the widths of its head h mod H₀. With random weights only the widths matter to decode speed, so this is the
    tuned recipe's cost on a shape it cannot be tuned on."""
    config = tuned_config(folder)
    source = config["tuned_for"]
    text = model.config.get_text_config(decoder=True)
    layers, heads = text.num_hidden_layers, text.num_key_value_heads

    def side(spec):  # a per-head side's groups, over this model's heads (a group that no head falls in is dropped)
        if not isinstance(spec, dict):
            return spec
        groups = [([h for h in range(heads) if h % source["kv_heads"] in group], chain)
                  for group, chain in zip(spec["heads"], spec["chains"])]
        groups = [(group, chain) for group, chain in groups if group]
        return groups[0][1] if len(groups) == 1 else {"heads": [g for g, _ in groups], "chains": [c for _, c in groups]}

    specs = layer_specs(config)
    picked = {i: round(i * (source["layers"] - 1) / max(layers - 1, 1)) for i in range(layers)}
    config["layers"] = {str(i): {s: side(specs[j][s]) for s in ("keys", "values")}
                        for i, j in picked.items() if j in specs}
    config["tuned_for"] = arch.fingerprint(model)
    return torchkv.KVPipeline.from_config(config)


def row_method(name: str, model, tuned: Path) -> Method:
    """`method(name)`, where `tuned` and `compiled:tuned` are the folder `tuned` placed on `model` (`on_shape`)."""
    if name.removeprefix(COMPILED) != TUNED_ROW:
        return method(name)
    return Method(name, pipeline=on_shape(tuned, model), compiled=name.startswith(COMPILED))


def weight_bytes_read(model) -> int:
    """Bytes of the weights a decode step reads: every parameter once, except an untied input embedding table (a step
    reads only its batch's rows of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        embed = model.get_input_embeddings().weight
        total -= embed.numel() * embed.element_size()
    return total


def fp16_cache_bytes(config, batch: int, context: int) -> int:
    """Bytes of a 16-bit KV cache of `context` tokens: keys and values, [batch, kv_heads, context, head_dim] each,
    per layer."""
    return 2 * config.num_hidden_layers * batch * config.num_key_value_heads * config.head_dim * context * FP16_BYTES


def _last_logits_only(model) -> dict:
    """The keyword that keeps only the last position's logits (no [B, T, vocab] tensor in a prefill):
    `logits_to_keep` (transformers >= 4.50), `num_logits_to_keep` before."""
    accepted = inspect.signature(model.forward).parameters
    return next(({key: 1} for key in ("logits_to_keep", "num_logits_to_keep") if key in accepted), {})


def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed `ids` [B, T] into `cache` `chunk` tokens at a time; returns the last position's logits [B, 1, vocab]."""
    passed, keep = cache_argument(model, cache), _last_logits_only(model)
    for start in range(0, ids.shape[1], chunk):
        logits = model(input_ids=ids[:, start : start + chunk], **passed, use_cache=True, **keep).logits
    return logits[:, -1:]


def decode(forward, model, cache, logits: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` greedy decode steps, each one token per row (`input_ids` [B, 1]); returns the last logits."""
    passed = cache_argument(model, cache)
    for _ in range(steps):
        token = logits[:, -1:].argmax(-1)
        logits = forward(input_ids=token, **passed, use_cache=True).logits
    return logits


def random_ids(batch: int, length: int, vocab: int, device: torch.device, seed: int) -> torch.Tensor:
    """Token ids [batch, length] drawn uniformly from [0, vocab)."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def _graphs() -> int:
    """Graphs Dynamo has compiled in this process."""
    return counters["stats"]["unique_graphs"]


def _timed(device: torch.device, fn):
    """(fn(), its seconds, the graphs compiled while it ran: one compiled in a timed phase makes its time suspect)."""
    graphs = _graphs()
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start, _graphs() - graphs


def warm_up(model, row, batch: int) -> None:
    """Untimed runs on two short prompts (`speed.warm_lengths`), each fed in two chunks, then `WARM_STEPS` decode
    steps for rows not compiled whole (their whole-step graphs depend on the capacity): a graph compiled for the first
    run's sizes is recompiled size-generic for the second, so the timed prefill and steps reuse the per-layer graphs."""
    for length in warm_lengths(row):
        cache = row.new_cache(model, max_cache_len=length + WARM_STEPS)
        ids = random_ids(batch, length, model.config.vocab_size, model.device, seed=length)
        logits = prefill(model, cache, ids, -(-length // 2))
        if not row.compiled:
            decode(model, model, cache, logits, WARM_STEPS)


def untimed_steps(row, warmup: int) -> int:
    """Decode steps to run before timing: `warmup`, and for a torchkv row one chunk of steps more, so that its window
    has filled and encoded a chunk once, compiling what that runs."""
    return warmup + (0 if row.pipeline is None else row.pipeline.chunk)


@torch.no_grad()
def measure_row(model, name: str, batch: int, context: int, steps: int, warmup: int,
                tuned: Path = TUNED_FOLDER) -> dict:
    """Prefill a `batch` x `context` random prompt into a fresh cache of row `name` twice (each timed; the first,
    `first_prefill_ms`, also pays what runs once per prompt size without a Dynamo recompile, on a GPU likely Triton
    specializing Inductor's kernels for new sizes; the second, `prefill_ms`, is the steady state), run `warmup` steps on
    the second (where whole-step graphs compile; torchkv rows run one chunk of steps more, so that the window has
    filled and encoded a chunk once, compiling what that runs), then time `steps` more. `graphs_compiled` counts the
    graphs compiled in each phase (0 in the timed steps, or their time includes compilation); `bytes_per_step` is what
    a step reads at least, the weights and the cache as stored; `tuned`: the folder of the `tuned` rows."""
    row = row_method(name, model, tuned)
    device = model.device
    chunk = min(context, PREFILL_CHUNK, max(1, PREFILL_TOKENS // batch))
    warmup = untimed_steps(row, warmup)
    with _compiled_at_first_call(row.pipeline), row.active(model):
        warm_up(model, row, batch)
        first_ids = random_ids(batch, context, model.config.vocab_size, device, seed=1)
        cache = row.new_cache(model, max_cache_len=context + warmup + steps)
        _, first_prefill_s, first_graphs = _timed(device, lambda: prefill(model, cache, first_ids, chunk))
        del cache, first_ids
        _free()
        ids = random_ids(batch, context, model.config.vocab_size, device, seed=0)
        cache = row.new_cache(model, max_cache_len=context + warmup + steps)
        forward = row.decode_forward(model)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        logits, prefill_s, prefill_graphs = _timed(device, lambda: prefill(model, cache, ids, chunk))
        logits, warmup_s, warmup_graphs = _timed(device, lambda: decode(forward, model, cache, logits, warmup))
        _, decode_s, decode_graphs = _timed(device, lambda: decode(forward, model, cache, logits, steps))
    result = {"first_prefill_ms": 1e3 * first_prefill_s, "prefill_ms": 1e3 * prefill_s, "prefill_chunk": chunk,
              "warmup_steps": warmup, "warmup_s": warmup_s,
              "ms_per_step": 1e3 * decode_s / steps, "tokens_per_s": batch * steps / decode_s,
              "cache_bytes": cache_nbytes(cache), "whole_step_compiled": row.compiled, "config": row.config(),
              "graphs_compiled": {"first_prefill": first_graphs, "prefill": prefill_graphs, "warmup": warmup_graphs,
                                  "timed_steps": decode_graphs}}
    result["bytes_per_step"] = weight_bytes_read(model) + result["cache_bytes"]
    if hasattr(cache, "encoded_bits_per_value"):
        result["bits_per_value"] = cache.encoded_bits_per_value()
    if device.type == "cuda":
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def fp16_limit(model, batch: int, context: int, bandwidth: float) -> dict:
    """The computed row: a step reading the weights and a 16-bit cache of the cell at the measured copy bandwidth."""
    nbytes = weight_bytes_read(model) + fp16_cache_bytes(model.config, batch, context)
    ms = 1e3 * nbytes / bandwidth
    return {"computed": True, "ms_per_step": ms, "tokens_per_s": batch * 1e3 / ms, "bytes_per_step": nbytes,
            "cache_bytes": fp16_cache_bytes(model.config, batch, context)}


def add_ratios(rows: list[dict], bandwidth: float) -> None:
    """Derived columns of one cell's measured rows, in place: the bandwidth their bytes per step reach (bytes/s and
    a fraction of the copy `bandwidth`), decode speed relative to `static-compiled` and `dynamic` (their ms over the
    row's ms: above 1 is faster), prefill time relative to `dynamic` (the row's ms over dynamic's: above 1 is
    slower)."""
    by_name = {r["row"]: r for r in rows if "ms_per_step" in r}
    for r in by_name.values():
        r["bytes_per_s"] = r["bytes_per_step"] / (r["ms_per_step"] / 1e3)
        r["fraction_of_copy_bandwidth"] = r["bytes_per_s"] / bandwidth
        for ref, key in ((STATIC_BASELINE, "x_static_compiled"), ("dynamic", "x_dynamic")):
            if ref in by_name:
                r[key] = by_name[ref]["ms_per_step"] / r["ms_per_step"]
        if "prefill_ms" in r and "prefill_ms" in by_name.get("dynamic", {}):
            r["prefill_x_dynamic"] = r["prefill_ms"] / by_name["dynamic"]["prefill_ms"]


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown(results: dict) -> str:
    """One table per cell: speed, ratios, bytes read per step and the bandwidth they reach, prefill."""
    meta = results["meta"]
    out = [f"# Decode on {meta['device_name']} ({meta['dtype']}, random weights)", "", meta["random_weights"], "",
           f"Copy bandwidth {meta['copy_bandwidth_bytes_per_s'] / GB:.0f} GB/s; {meta['steps']} timed steps after "
           f"{meta['warmup']} warm-up steps. x static-compiled and x dynamic: their ms over the row's (above 1 is "
           "faster); first prefill: the first prompt of the cell's size; prefill: the next one (steady); prefill / "
           "dynamic: the row's steady prefill time over dynamic's.", ""]
    header = ["row", "ms/step", "tok/s", "x static-compiled", "x dynamic", "cache GB", "bytes/step GB", "GB/s",
              "% of copy bw", "first prefill ms", "prefill ms", "prefill / dynamic", "warm-up s"]
    for cell in dict.fromkeys((r["shape"], r["batch"], r["context"]) for r in results["rows"]):
        lines = []
        for r in (r for r in results["rows"] if (r["shape"], r["batch"], r["context"]) == cell):
            if "ms_per_step" not in r:
                note = (r.get("error") or r.get("skipped", "")).replace("|", "/").replace("\n", " ")[:200]
                lines.append([r["row"], note] + [""] * (len(header) - 2))
                continue
            lines.append([r["row"], _fmt(r["ms_per_step"], ".2f"), _fmt(r["tokens_per_s"], ".0f"),
                          _fmt(r.get("x_static_compiled"), ".2f"), _fmt(r.get("x_dynamic"), ".2f"),
                          _fmt(r["cache_bytes"] / GB, ".2f"), _fmt(r["bytes_per_step"] / GB, ".2f"),
                          _fmt(r["bytes_per_s"] / GB, ".0f"), _fmt(100 * r["fraction_of_copy_bandwidth"], ".0f"),
                          _fmt(r.get("first_prefill_ms"), ".0f"), _fmt(r.get("prefill_ms"), ".0f"),
                          _fmt(r.get("prefill_x_dynamic"), ".2f"),
                          _fmt(r.get("warmup_s"), ".1f")])
        out += [f"## {cell[0]} batch {cell[1]} x {cell[2]} tokens", "", *_table(header, lines), ""]
    kernels = results.get("kernel", [])
    if kernels:
        lines = [[r["row"], f"{r['shape']} b{r['batch']} x {r['context']}", r.get("error", "")[:200]] + [""] * 5
                 if "error" in r else
                 [r["row"], f"{r['shape']} b{r['batch']} x {r['context']}", "Triton" if r["kernel"] else "Inductor",
                  _fmt(r["torchkv_ms"], ".3f"), _fmt(r["achieved_bytes_per_s"] / GB, ".0f"),
                  _fmt(100 * r["fraction_of_copy_bandwidth"], ".0f"), _fmt(r["dynamic_ms"], ".3f"),
                  _fmt(r["speedup"], ".2f")] for r in kernels]
        header = ["kernel", "cell", "path", "ms (one layer)", "GB/s of stored bytes", "% of copy bw",
                  "SDPA over the uncompressed cache, ms", "x SDPA"]
        out += ["## One layer's decode attention (on CUDA timed as CUDA graph replays)", "", *_table(header, lines), ""]
    return "\n".join(out)


def plot(results: dict, path: Path) -> None:
    """Bars of each row's decode speed relative to `static-compiled` (or `dynamic` where no cell has it), per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    key, ref = ("x_static_compiled", STATIC_BASELINE) if any("x_static_compiled" in r for r in rows) else (
        "x_dynamic", "dynamic")
    cells = list(dict.fromkeys((r["shape"], r["batch"], r["context"]) for r in rows))
    names = list(dict.fromkeys(r["row"] for r in rows))
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cells) * max(1, len(names)) / 3), 4.5))
    for i, name in enumerate(names):
        values = [next((r.get(key, 0) for r in rows if r["row"] == name and (r["shape"], r["batch"], r["context"])
                        == cell), 0) for cell in cells]
        ax.bar([c + (i - (len(names) - 1) / 2) * width for c in range(len(cells))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cells)), [f"{s} b{b} x {c}" for s, b, c in cells])
    ax.set_ylabel(f"decode speed / {ref}")
    ax.set_title(f"Decode speed vs {ref}: {results['meta']['device_name']}, random weights")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_stem(out_dir: Path, device_name: str) -> Path:
    """This run's path stem, DIR/gpu_decode_<device slug>_<timestamp>, numbered if an earlier run took it."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    base = out_dir / f"gpu_decode_{slug}_{time.strftime('%Y%m%d-%H%M%S')}"
    stem, n = base, 1
    while stem.with_suffix(".json").exists():
        n += 1
        stem = base.with_name(f"{base.name}-{n}")
    return stem


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_row(model, name: str, cell: dict, args, compiled: bool) -> dict:
    """One row of a cell: measured, or the error that stopped it; then the memory it held is given back."""
    row = {**cell, "row": name}
    try:
        row.update(measure_row(model, name, cell["batch"], cell["context"], args.steps, args.warmup, args.tuned))
    except Exception as err:  # an OOM or a failing row is recorded, and the run goes on
        traceback.print_exc()
        row["error"] = f"{type(err).__name__}: {err}"[:1000]
    if compiled:
        torch._dynamo.reset()  # frees the row's graphs, CUDA graphs and their memory pool included
    _free()
    return row


def run_kernel(model, preset: str, cell: dict, dtype: torch.dtype, bandwidth: float) -> dict:
    """One layer's decode attention at the cell's shape (`decode.kernel_row`: on CUDA the calls replay as a CUDA
    graph): the stored bytes it reads per call over its time, against the copy bandwidth, beside SDPA over the
    full-precision cache; or the error that stopped it."""
    config = model.config
    row = {**cell, "row": f"kernel:{preset}"}
    try:
        row.update(kernel_row(preset, cell["context"], cell["batch"], model.device, config.num_key_value_heads,
                              config.num_attention_heads // config.num_key_value_heads, config.head_dim, dtype))
        row["fraction_of_copy_bandwidth"] = row["achieved_bytes_per_s"] / bandwidth
        row["sdpa_bytes_per_s"] = row["full_precision_bytes"] / (row["dynamic_ms"] / 1e3)
    except Exception as err:
        traceback.print_exc()
        row["error"] = f"{type(err).__name__}: {err}"[:1000]
    _free()
    return row


def run_meta(args, device: torch.device, bandwidth: float, command: str) -> dict:
    """Versions, device, copy bandwidth, settings and the note on random weights."""
    try:
        import triton
    except ImportError:
        triton = None
    return {"kind": "gpu-decode-benchmark", "device_name": device_name(device), "device": str(device),
            "dtype": args.dtype, "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": getattr(triton, "__version__", None), "torchkv": torchkv.__version__, "machine": machine(),
            "copy_bandwidth_bytes_per_s": bandwidth, "random_weights": RANDOM_WEIGHTS,
            "shapes": {shape: SHAPES[shape] for shape, _, _ in parse_cells(args.cells)}, "steps": args.steps,
            "warmup": args.warmup, "command": command, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "finished": False}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> Path:
    """Run every cell's rows in order; returns the JSON's path."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default="1b:1x4096,1b:1x32768,1b:16x16384,8b:8x32768",
                        help="SHAPE:BATCHxCONTEXT, SHAPE one of " + ", ".join(SHAPES))
    parser.add_argument("--rows", default=f"dynamic,{STATIC_BASELINE},kivi-2bit,compiled:kivi-2bit,compiled:kivi-4bit,"
                                          "frontier-2bit,compiled:frontier-2bit,compiled:tuned")
    parser.add_argument("--kernel-presets", default="kivi-2bit,kivi-4bit,frontier-2bit",
                        help="presets whose decode attention of one layer is timed alone in every cell")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps before them")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--deadline-seconds", type=float, default=330,
                        help="rows not started by then (seconds after the start) are recorded as skipped")
    parser.add_argument("--out", default="benchmarks/results/gpu", help="folder of this run's JSON, MD and PNG")
    parser.add_argument("--tuned", type=Path, default=TUNED_FOLDER,
                        help="a `torchkv tune` folder whose widths the rows `tuned` and `compiled:tuned` place on each "
                             "shape")
    parser.add_argument("--kernel-settings", type=Path,
                        help="a `kernel_sweep.py` JSON: run the kernel with the best launch settings it measured")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    start = time.perf_counter()
    cells, names = parse_cells(args.cells), [n for n in args.rows.split(",") if n]
    compiled = set()
    for name in names:  # an unknown row name, or a `--tuned` folder without a tuned pipeline, fails before measuring
        if name.removeprefix(COMPILED) == TUNED_ROW:
            tuned_config(args.tuned)
            whole_step = name.startswith(COMPILED)
        else:
            whole_step = method(name).compiled
        if whole_step:
            compiled.add(name)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(device)
    command = " ".join(sys.argv if argv is None else [__file__, *argv])
    results = {"meta": run_meta(args, device, bandwidth, command), "rows": [], "kernel": []}
    if args.kernel_settings and args.kernel_settings.exists():
        best = json.loads(args.kernel_settings.read_text()).get("best")
        for name, value in (best or {}).get("settings", {}).items():
            setattr(triton_decode, name, value)
    results["meta"]["kernel_settings"] = {name: getattr(triton_decode, name) for name in (
        "BLOCK_T", "PRECISION", "NUM_WARPS", "NUM_STAGES", "TARGET_PROGRAMS", "MIN_SPLIT_BLOCKS")}
    stem = _run_stem(Path(args.out), device_name(device))
    stem.parent.mkdir(parents=True, exist_ok=True)

    def write(with_plot: bool) -> None:
        results["meta"]["elapsed_s"] = time.perf_counter() - start
        _write(stem.with_suffix(".json"), results)
        stem.with_suffix(".md").write_text(markdown(results))
        if with_plot:
            plot(results, stem.with_suffix(".png"))

    model, model_shape = None, None
    for shape, batch, context in cells:
        if shape != model_shape:
            model = None
            _free()
            built = time.perf_counter()
            model, model_shape = build_model(shape, device, dtype), shape
            results["meta"].setdefault("build_s", {})[shape] = time.perf_counter() - built
        cell = {"shape": shape, "batch": batch, "context": context}
        cell_rows = [{**cell, "row": FP16_LIMIT, **fp16_limit(model, batch, context, bandwidth)}]
        results["rows"].append(cell_rows[0])
        for preset in filter(None, args.kernel_presets.split(",")):
            results["kernel"].append(run_kernel(model, preset, cell, dtype, bandwidth))
            print(results["kernel"][-1], flush=True)
        for name in names:
            if time.perf_counter() - start > args.deadline_seconds:
                row = {**cell, "row": name, "skipped": "skipped: deadline"}
            else:
                row = run_row(model, name, cell, args, name in compiled)
            cell_rows.append(row)
            results["rows"].append(row)
            add_ratios(cell_rows, bandwidth)
            print({k: v for k, v in row.items() if k != "config"}, flush=True)
            write(with_plot=False)
        write(with_plot=True)
    results["meta"]["finished"] = True
    write(with_plot=True)
    print(markdown(results), flush=True)
    return stem.with_suffix(".json")


if __name__ == "__main__":
    main()
