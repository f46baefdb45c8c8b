"""Copy a saved pipeline folder with every value quantizer's scales unbiased (`unbiased=True`), its widths unchanged.

The ablation of stop 90: a folder tuned with MSE-optimal value scales, whose rows the code shrinks by about its
relative error (a third at 1 bit), read with each token's value scale refitted so that `v·v̂ = ‖v‖²`
(`quantizers.unbiased_scale`). Keys keep their MSE-optimal scales. The copy keeps the other files (`tune.json`), so
it is refused on another model and reports its calibration domain like its source:

    python benchmarks/unbias_values.py SRC_FOLDER OUT_FOLDER [--max-bits 1]

`--max-bits B` unbiases only the value quantizers of at most B bits (the 1-bit codes shrink a row by about a third,
the 2-bit ones by about an eighth).
"""

import argparse
import json
import shutil
from pathlib import Path

from torchkv.pipeline import KVPipeline


def unbias(src: Path, out: Path, max_bits: float | None = None) -> int:
    """Copy the folder `src` to `out` with its value quantizers of at most `max_bits` bits (all where None) set
    `unbiased`; the number of quantizers set. The copy's `options` record `unbiased_values`."""
    config = json.loads((src / "torchkv_config.json").read_text())
    sides = [config["values"], *(layer["values"] for layer in config["layers"].values() if "values" in layer)]
    chains = [c for side in sides for c in (side["chains"] if isinstance(side, dict) else [side])]  # head groups
    quantizers = [t for chain in chains for t in chain if t["kind"] == "quantize"
                  and (max_bits is None or t["config"]["bits"] <= max_bits)]
    if not quantizers:
        raise ValueError(f"{src}: no value quantizer to unbias"
                         + ("" if max_bits is None else f" of at most {max_bits:g} bits"))
    for t in quantizers:
        t["config"]["unbiased"] = True
    config["options"]["unbiased_values"] = True if max_bits is None else f"up to {max_bits:g} bits"
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():  # tune.json, fitted parameters
        if path.is_file() and path.name != "torchkv_config.json":
            shutil.copy(path, out / path.name)
    (out / "torchkv_config.json").write_text(json.dumps(config, indent=2) + "\n")
    KVPipeline.from_pretrained(out)  # the copy loads (every option valid)
    return len(quantizers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-bits", type=float, help="unbias only the value quantizers of at most this width")
    args = parser.parse_args()
    try:
        count = unbias(args.src, args.out, args.max_bits)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    print(f"wrote {args.out}: {count} value quantizers unbiased")


if __name__ == "__main__":
    main()
