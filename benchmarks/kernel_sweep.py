"""Launch settings of the Triton decode kernel over KIVI's stored form (`torchkv.ops.triton_decode`), swept on a GPU
one factor at a time from the defaults: ms per call of one layer (20 calls replayed as a CUDA graph), the stored
bytes it reads per second against the device's copy bandwidth, and the largest error against the eager reference.

    python benchmarks/kernel_sweep.py --out benchmarks/results/gpu/kernel_sweep.json
"""

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

import torchkv
from torchkv.ops import triton_decode

_spec = importlib.util.spec_from_file_location("decode_benchmark", Path(__file__).with_name("decode.py"))
_decode_benchmark = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_decode_benchmark)

#: (label, batch, KV heads, query heads, head_dim, encoded tokens): one layer of the 1B and the 8B Llama shapes
CELLS = [("1b b16 x 16K", 16, 8, 32, 64, 16384), ("8b b8 x 32K", 8, 8, 32, 128, 32768)]
#: module settings of `triton_decode` and the values tried for each (None: the kernel's choice by shape and dtype)
SETTINGS = {"BLOCK_T": [16, 32, 64], "PRECISION": [None, "tf32", "tf32x3"], "NUM_WARPS": [None, 2, 4, 8],
            "NUM_STAGES": [2, 3, 4], "TARGET_PROGRAMS": [512, 2048, 4096]}


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
    results = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "copy_bandwidth_bytes_per_s": bandwidth, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "defaults": {k: getattr(triton_decode, k) for k in SETTINGS}}, "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for preset in args.presets.split(","):
        for label, *shape in CELLS:
            call, nbytes = layer_inputs(preset, *shape)
            expected = triton_decode.kivi_decode_reference(*call)[0]
            for name, values in SETTINGS.items():
                default = getattr(triton_decode, name)
                for value in values:
                    setattr(triton_decode, name, value)
                    row = {"preset": preset, "cell": label, "setting": name, "value": value, "bytes": nbytes}
                    try:
                        error = (triton_decode.kivi_decode(*call)[0] - expected).abs().max().item()
                        seconds = _decode_benchmark._timed(lambda: triton_decode.kivi_decode(*call), 20, device)
                        row.update(ms=1e3 * seconds, max_error=error,
                                   fraction_of_copy_bandwidth=nbytes / seconds / bandwidth)
                    except Exception as err:
                        row["error"] = f"{type(err).__name__}: {err}"[:500]
                    setattr(triton_decode, name, default)
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    out.write_text(json.dumps(results, indent=1))
            del call, expected
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
