"""Decode benchmark: SmolLM2 decode and prefill throughput and peak memory for every cache, same run.

Rows: transformers' DynamicCache (the reference), its StaticCache with the whole decode step compiled
(`static-compiled`, the fastest full-precision path of transformers) and QuantizedCache (quanto, 4 and 2 bits), every
torchkv preset with per-layer compiled attention, and `--compiled-presets` with the whole decode step compiled over
a fixed-capacity torchkv cache (`compiled:PRESET`); for fp32 and bf16 weights, contexts 1K/4K/8K, batch 1 and 8. Ratios are to the
DynamicCache of the same cell. A kernel-level section times one layer's decode attention over packed
codes against SDPA over the full-precision cache, and the bytes/s it reaches against the machine's
measured copy bandwidth.

    python benchmarks/decode.py --out benchmarks/results/decode/decode_cpu.json
    python benchmarks/decode.py --append --batches 8 --contexts 8192 --presets kivi-2bit --out ...  # more cells
    python benchmarks/decode.py --cells 4096x1,8192x8 --dtypes float32 --out ...  # only these cells
    python benchmarks/decode.py --cells 4096x1 --baselines dynamic --presets X --append --out ...  # a fresh process per row
    python benchmarks/decode.py --batch-invariant ...  # each row also with batch-invariant linear layers
    python benchmarks/decode.py --cells 8192x1 --dtypes float32 --baselines '' --presets '' --compiled-presets ''
        --kernel-presets frontier-2bit,TUNED_FOLDER --kernel-layers 0-29 --out ...  # each layer's attention alone
    python benchmarks/decode.py --device cuda --dtypes bfloat16 --out benchmarks/results/decode/decode_h100_bf16.json
    torchkv report benchmarks/results/decode/decode_cpu.json

The full grid of every preset is hours on a 2-core CPU; each run's arguments are kept in meta.runs.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import torchkv
from torchkv.eval.rows import BASELINES, COMPILED, STATIC_BASELINE, method
from torchkv.eval.runner import machine
from torchkv.eval.speed import generation_profile, sync
from torchkv.models.loader import SMOLLM2
from torchkv.positions import SharedRope
from torchkv.testing import llama_rope, rope_tables


def copy_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, reps: int = 10) -> float:
    """Measured memory copy bandwidth, bytes/s (read + write of `nbytes`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - start)


def _timed(fn, reps: int, device: torch.device) -> float:
    """Seconds per call of `fn` after two warm-up calls. On CUDA the `reps` calls are captured in one CUDA graph and
    replayed, so that the device time is measured without the host's launch gaps."""
    fn()
    fn()
    sync(device)
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        sync(device)
        start = time.perf_counter()
        graph.replay()
        sync(device)
        return (time.perf_counter() - start) / reps
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps


def layer_list(text: str) -> list[int]:
    """The layers of "0,11", "0-29" or both ("0-3,11"), in order."""
    layers = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        layers += range(int(first), int(last or first) + 1)
    return layers


def kernel_pipeline(preset: str, layer: int, heads: int = 3, dim: int = 64) -> torchkv.KVPipeline:
    """The compiled pipeline of `layer` of a preset (128-token window) or of a saved pipeline's folder (a tuned one
    has widths of its own per layer and KV head), for a layer of `heads` KV heads of `dim`."""
    if Path(preset).is_dir():
        pipe = torchkv.KVPipeline.from_pretrained(preset)
        made_for = pipe.tuned_for or pipe.fitted_for or {}
        shape = made_for.get("kv_heads", heads), made_for.get("head_dim", dim)
        if shape != (heads, dim):
            raise ValueError(f"{preset} was made for layers with kv_heads={shape[0]}, head_dim={shape[1]}; this "
                             f"kernel row times kv_heads={heads}, head_dim={dim}: give it a pipeline made for that")
        pipe.compile = True
    else:
        pipe = torchkv.KVPipeline.from_preset(preset, residual=128, compile=True)
    return pipe.for_layer(layer)


def kernel_row(preset: str, context: int, batch: int, device: torch.device, heads=3, groups=3, dim=64,
               dtype=torch.float32, layer: int = 0) -> dict:
    """Decode attention of `layer`: torchkv over packed codes (on CUDA the Triton kernel, where the preset has one)
    vs DynamicCache's concat + SDPA over the full-precision cache in `dtype`."""
    pipe = kernel_pipeline(preset, layer, heads, dim)
    gen = torch.Generator().manual_seed(0)
    window = pipe.residual
    n_enc = (context - window) // pipe.chunk * pipe.chunk
    if n_enc <= 0:
        raise ValueError(f"a kernel row of {preset} needs a context of at least {window + pipe.chunk} tokens (the "
                         f"{window}-token window and one {pipe.chunk}-token chunk), not {context}")

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    k, v = randn(batch, heads, n_enc, dim), randn(batch, heads, n_enc, dim)
    # the encoded tokens' rotary tables, for pipelines that read positions (pre-RoPE keys, a turned key centre)
    rope = ({n: t.to(device, dtype) for n, t in rope_tables(batch, n_enc, dim).items()}
            if {"cos", "sin"} & pipe.requires else {})
    prepared = None
    if pipe.needs_prepare:  # per-prompt state (frontier's balance scales) from the prompt's queries
        prepared = pipe.prepare(k, v, inputs={"queries": randn(batch, heads * groups, n_enc, dim), **rope})
    state = pipe.encode_chunk(k, v, prepared=prepared, inputs=rope)
    chunks = n_enc // pipe.chunk
    encoded = {n: t.unflatten(2, (chunks, t.shape[2] // chunks)) for n, t in state.items()}
    k_fp, v_fp = randn(batch, heads, context - n_enc, dim), randn(batch, heads, context - n_enc, dim)
    q = randn(batch, heads * groups, 1, dim)
    def attend(inputs):
        return _timed(lambda: pipe.attend_decode(q, encoded, k_fp, v_fp, None, dim**-0.5, prepared=prepared,
                                                 inputs=inputs), 20, device)

    by_token = {}
    if pipe.codec.attention_rope == "chunks":  # what a store passes (a turned centre's tables by chunk), and the
        # every-token tables it falls back to where positions do not run on
        shared = SharedRope(lambda positions: tuple(t.to(dtype) for t in llama_rope(positions, dim)))
        by_token = {"token_tables_ms": 1e3 * attend(rope)}
        rope = shared.chunk_tables(torch.arange(n_enc, device=device)[None].expand(batch, -1), 0, n_enc, pipe.chunk)
    fused_s = attend(rope)
    full_k, full_v = torch.cat([k, k_fp[:, :, :-1]], 2), torch.cat([v, v_fp[:, :, :-1]], 2)

    def dynamic_step():
        kk, vv = torch.cat([full_k, k_fp[:, :, -1:]], 2), torch.cat([full_v, v_fp[:, :, -1:]], 2)
        return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

    sdpa_s = _timed(dynamic_step, 20, device)
    compressed = sum(t.numel() * t.element_size() for t in state.values())
    return {
        "preset": preset, "layer": layer, "context": context, "batch": batch, "torchkv_ms": 1e3 * fused_s,
        "dynamic_ms": 1e3 * sdpa_s, "speedup": sdpa_s / fused_s, "compressed_bytes": compressed,
        "fp32_bytes": 2 * full_k.numel() * 4, "full_precision_bytes": 2 * full_k.numel() * full_k.element_size(),
        "achieved_bytes_per_s": compressed / fused_s, "dtype": str(dtype).removeprefix("torch."),
        "kernel": pipe.kernel_refusal(dim) is None and device.type == "cuda", **by_token,
    }


def summarize(profiles: list[dict], reference: list[dict]) -> dict:
    """One row from its rounds' profiles: the median throughputs, and the median of its ratios to the reference row
    in the same round (paired, so that the machine's drift between rounds cancels); every round's figures are kept."""
    row = dict(profiles[-1])
    del row["round"]
    for what in ("decode", "prefill"):
        key = f"{what}_tokens_per_s"
        row[key] = statistics.median(p[key] for p in profiles)
        row[f"{what}_ratio"] = statistics.median(p[key] / ref[key] for p, ref in zip(profiles, reference))
    if len(profiles) > 1:
        row["rounds"] = [{k: p[k] for k in ("decode_tokens_per_s", "prefill_tokens_per_s")} for p in profiles]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2, help="a known model name or a local folder")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--cells", help="context x batch pairs instead of every --contexts x --batches pair, "
                                        "e.g. 4096x1,8192x8")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--presets", default=",".join(p["name"] for p in torchkv.presets() if not p["calibrate"]))
    parser.add_argument("--compiled-presets", default="kivi-2bit,kivi-4bit",
                        help="presets also measured with the whole decode step compiled (rows compiled:PRESET)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prefill-runs", type=int, default=1, help="prefills per row; the median is reported")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each row of a cell is measured, the rows taken in turn (forward, then backward); "
                             "medians are reported, ratios paired by round")
    parser.add_argument("--kernel-presets", default="kivi-2bit,kivi-4bit",
                        help="presets or saved pipelines' folders whose decode attention of one layer is timed")
    parser.add_argument("--kernel-layers", default="0", type=layer_list,
                        help="the layers timed for each kernel preset, e.g. 0,11 or 0-29 (a tuned folder's widths "
                             "differ by layer)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/decode/decode_cpu.json")
    parser.add_argument("--append", action="store_true", help="add this run's rows to the JSON at --out")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="each row also measured with the model's linear layers in fixed blocks of rows "
                             "(rows 'NAME (batch-invariant)', `torchkv.patch(..., batch_invariant=True)`)")
    parser.add_argument("--baselines", default=",".join(["dynamic", STATIC_BASELINE, *list(BASELINES)[1:]]), help="baseline rows, the first the reference "
                        "of the ratios (a row per process: --baselines dynamic --presets X --append)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: measure each row at least once (--rounds 1)")
    device = torch.device(args.device)
    if args.cells:
        cells = [tuple(int(n) for n in cell.split("x")) for cell in args.cells.split(",")]
    else:
        cells = [(int(c), int(b)) for b in args.batches.split(",") for c in args.contexts.split(",")]
    names = [b for b in args.baselines.split(",") if b] + [p for p in args.presets.split(",") if p]
    names += [COMPILED + p for p in args.compiled_presets.split(",") if p]
    out = Path(args.out)
    bandwidth = copy_bandwidth(device)
    run = {"copy_bandwidth_bytes_per_s": bandwidth, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "argv": argv if argv is not None else sys.argv[1:]}
    if args.append and out.is_file():
        results = json.loads(out.read_text())
        results["meta"]["runs"].append(run)
    else:
        results = {
            "meta": {"kind": "decode-benchmark", "model": args.model, "torchkv": torchkv.__version__,
                     "torch": torch.__version__, "machine": machine(), "device": str(device),
                     "new_tokens": args.new_tokens, "runs": [run]},
            "rows": [],
            "kernel": [],
        }
    kernel_cells = [(preset, cell, layer) for preset in filter(None, args.kernel_presets.split(","))
                    for cell in cells for layer in args.kernel_layers]
    for preset, (context, batch), layer in kernel_cells:
        row = kernel_row(preset, context, batch, device, layer=layer)
        row["fraction_of_copy_bandwidth"] = row["achieved_bytes_per_s"] / bandwidth
        results["kernel"].append(row)
        print(json.dumps(row), flush=True)
    for dtype in args.dtypes.split(","):
        model, tokenizer = torchkv.load_model(args.model, dtype=getattr(torch, dtype))
        model.to(device)
        for context, batch in cells:
            rows = {}
            for name in names:
                for invariant in (False, True) if args.batch_invariant else (False,):
                    rows[f"{name} (batch-invariant)" if invariant else name] = row = method(name)
                    row.batch_invariant = invariant
            rounds = {label: [] for label in rows}
            for r in range(args.rounds):  # forward, then backward: a drift of the machine's speed weighs every row
                for label in list(rows)[:: 1 if r % 2 == 0 else -1]:
                    profile = generation_profile(
                        model, tokenizer, rows[label], context, args.new_tokens, batch, args.prefill_runs)
                    profile.update(name=label, dtype=dtype, round=r)
                    rounds[label].append(profile)
                    print(json.dumps(profile), flush=True)
            cell = [summarize(profiles, rounds[names[0]]) for profiles in rounds.values()]
            results["rows"].extend(cell)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2))
        del model
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
