"""Launch settings of the Triton decode kernel over KIVI's stored form (`torchkv.ops.triton_decode`), swept on a GPU
over every combination of the values below: ms per call of one layer (20 calls replayed as a CUDA graph), the
stored bytes it reads per second against the device's copy bandwidth, and the largest error against the eager
reference. `best` is the combination with the least geometric mean over the cells of its time over the cell's
fastest; `benchmarks/gpu_decode.py --kernel-settings` applies it.

    python benchmarks/kernel_sweep.py --out benchmarks/results/gpu/kernel_sweep.json
"""

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import torch

import torchkv
from torchkv.ops import triton_decode
from torchkv.testing import load_script

_decode_benchmark = load_script(Path(__file__).with_name("decode.py"))

#: (label, batch, KV heads, query heads, head_dim, encoded tokens): one layer of the 1B and the 8B Llama shapes
CELLS = [("1b b16 x 16K", 16, 8, 32, 64, 16384), ("8b b8 x 32K", 8, 8, 32, 128, 32768)]
#: module settings of `triton_decode` and the values combined (None: the kernel's choice by shape and dtype)
SETTINGS = {"BLOCK_T": [32, 64, 128], "PRECISION": [None, "tf32"], "NUM_WARPS": [2, 4, 8], "NUM_STAGES": [2],
            "TARGET_PROGRAMS": [2048]}

def layer_inputs(preset: str, batch: int, heads: int, q_heads: int, dim: int, tokens: int, window: int = 128):
    """`kivi_decode`'s arguments for one layer: `tokens` random keys and values encoded by `preset`, a `window` of
    bf16 tokens, a bf16 query; and the stored bytes a call reads."""
    pipe = torchkv.KVPipeline.from_preset(preset, compile=False)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    state = pipe.encode_chunk(randn(batch, heads, tokens, dim), randn(batch, heads, tokens, dim))
    kf, vf = randn(batch, heads, window, dim), randn(batch, heads, window, dim)
    q = randn(batch, q_heads, dim).float() * dim**-0.5
    args = (q, q, state["k.out"], state["k.0.scale"], state["k.0.zero"], state["v.out"], state["v.0.scale"],
            state["v.0.zero"], kf, vf, None, None, None, 0.0,
            pipe.keys.transforms[0].config.bits, pipe.values.transforms[0].config.bits)
    nbytes = sum(t.numel() * t.element_size() for t in (*state.values(), kf, vf))
    return args, nbytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="kivi-2bit")
    parser.add_argument("--out", default="benchmarks/results/gpu/kernel_sweep.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    bandwidth = _decode_benchmark.copy_bandwidth(device)
    defaults = {name: getattr(triton_decode, name) for name in SETTINGS}
    results = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "copy_bandwidth_bytes_per_s": bandwidth, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "defaults": defaults}, "rows": [], "best": None}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    combos = [dict(zip(SETTINGS, values)) for values in itertools.product(*SETTINGS.values())]
    for preset in args.presets.split(","):
        for label, *shape in CELLS:
            call, nbytes = layer_inputs(preset, *shape)
            expected = triton_decode.kivi_decode_reference(*call)[0]
            for combo in combos:
                for name, value in combo.items():
                    setattr(triton_decode, name, value)
                row = {"preset": preset, "cell": label, "settings": combo, "bytes": nbytes}
                try:
                    error = (triton_decode.kivi_decode(*call)[0] - expected).abs().max().item()
                    seconds = _decode_benchmark._timed(lambda: triton_decode.kivi_decode(*call), 20, device)
                    row.update(ms=1e3 * seconds, max_error=error,
                               fraction_of_copy_bandwidth=nbytes / seconds / bandwidth)
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {err}"[:500]
                for name, value in defaults.items():
                    setattr(triton_decode, name, value)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
                results["best"] = best(results["rows"])
                out.with_suffix(".partial").write_text(json.dumps(results, indent=1))
                out.with_suffix(".partial").replace(out)  # whole at every moment: a time limit may stop the sweep
            del call, expected
            torch.cuda.empty_cache()


def best(rows: list[dict]) -> dict | None:
    """The settings measured in every cell with the least geometric mean of time over the cell's fastest."""
    fastest, ratios = {}, {}
    for row in rows:
        if "ms" in row:
            fastest[row["cell"]] = min(fastest.get(row["cell"], math.inf), row["ms"])
    for row in rows:
        if "ms" in row:
            ratios.setdefault(json.dumps(row["settings"], sort_keys=True), []).append(row["ms"] / fastest[row["cell"]])
    complete = {key: r for key, r in ratios.items() if len(r) == len(fastest)}
    if not complete:
        return None
    geomean = {key: math.exp(sum(map(math.log, r)) / len(r)) for key, r in complete.items()}
    key = min(geomean, key=geomean.get)
    return {"settings": json.loads(key), "geomean_over_fastest": geomean[key]}

if __name__ == "__main__":
    main()
