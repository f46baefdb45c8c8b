"""Copy a saved pipeline folder with every value quantizer's scales unbiased (`unbiased=True`), its widths unchanged.

The ablation of stop 90: a folder tuned with MSE-optimal value scales, whose rows the code shrinks by about its
relative error (a third at 1 bit), read with each token's value scale refitted so that `v·v̂ = ‖v‖²`
(`quantizers.unbiased_scale`). Keys keep their MSE-optimal scales. The copy keeps the other files (`tune.json`), so
it is refused on another model and reports its calibration domain like its source:

    python benchmarks/unbias_values.py SRC_FOLDER OUT_FOLDER
"""

import argparse
import json
import shutil
from pathlib import Path

from torchkv.pipeline import KVPipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    config = json.loads((args.src / "torchkv_config.json").read_text())
    sides = [config["values"], *(layer["values"] for layer in config["layers"].values() if "values" in layer)]
    chains = [c for side in sides for c in (side["chains"] if isinstance(side, dict) else [side])]  # head groups
    quantizers = [t for chain in chains for t in chain if t["kind"] == "quantize"]
    if not quantizers:
        raise SystemExit(f"{args.src}: no value quantizer to unbias")
    for t in quantizers:
        t["config"]["unbiased"] = True
    config["options"]["unbiased_values"] = True
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.src.iterdir():  # tune.json, fitted parameters
        if path.is_file() and path.name != "torchkv_config.json":
            shutil.copy(path, args.out / path.name)
    (args.out / "torchkv_config.json").write_text(json.dumps(config, indent=2) + "\n")
    KVPipeline.from_pretrained(args.out)  # the copy loads (every option valid)
    print(f"wrote {args.out}: {len(quantizers)} value quantizers unbiased")


if __name__ == "__main__":
    main()
