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
from pathlib import Path

from torchkv.fitting.tuning.unbiased import unbiased_values
from torchkv.pipeline import KVPipeline
from torchkv.pipeline.io import save_derived


def unbias(src: Path, out: Path, max_bits: float | None = None) -> int:
    """Copy the folder `src` to `out` with its value quantizers of at most `max_bits` bits (all where None) set
    `unbiased` (`torchkv.fitting.tuning.unbiased_values`); the number of quantizers set."""
    pipe, count = unbiased_values(KVPipeline.from_pretrained(src), max_bits)
    save_derived(pipe, src, out)
    return count


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
