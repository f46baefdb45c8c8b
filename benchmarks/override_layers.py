"""Copy a saved pipeline folder with some layers' key or value widths, metadata float type or chains changed.

An ablation of where a loss comes from: which side of which layers. Gemma 3 270M attends past 512 tokens only in its
full-attention layers (5, 11 and 17), so at 32K those layers' keys and values are all that retrieval reads:

    python benchmarks/override_layers.py SRC_FOLDER OUT_FOLDER --layers 5,11,17 [--key-bits 4] [--value-bits 4]
        [--meta-dtype float16] [--without balance] [--keys-from kivi-4bit] [--values-from kivi-4bit:group=128]

Widths are set as `torchkv tune` sets them (`candidates.rewidth`: a HIGGS grid of the largest dimension that has the
width, packs re-derived). `--meta-dtype` sets the float type of every quantizer's scales (`scale_dtype`) or
metadata (`meta_dtype`) in those layers; `--without NAME` drops the transforms of that name (`project.balance`:
keys stored without the query balance, scored with plain queries) from their chains. `--keys-from SPEC` and
`--values-from SPEC` put a preset's chain for that side in those layers (another code family under the same window
rules: KIVI's per-channel keys beside the folder's values), before any of the other changes. Other layers, the
window rules and the other files (`tune.json`) are kept, so the copy is refused on another model and reports its
calibration domain like its source; `options` record what was overridden. A calibrated folder (fitted parameters)
is refused: its parameters are stored by chain position, which new chains would not keep.
"""

import argparse
import dataclasses
from pathlib import Path

from torchkv.fitting.tuning.candidates import rewidth
from torchkv.pipeline import Chain, KVPipeline
from torchkv.pipeline.io import save_derived
from torchkv.pipeline.presets import from_preset
from torchkv.transforms import Transform

#: the quantizer fields that hold a float type of stored metadata
META_FIELDS = ("scale_dtype", "meta_dtype")


def _with_meta_dtype(transforms: list[Transform], dtype: str) -> list[Transform]:
    out = []
    for t in transforms:
        config = dataclasses.asdict(t.config)
        fields = [f for f in META_FIELDS if f in config] if t.kind == "quantize" else []
        out.append(type(t)(**{**config, **dict.fromkeys(fields, dtype)}) if fields else t)
    return out


def _side(chain: Chain, bits: float | None, meta_dtype: str | None, without: str | None, what: str
          ) -> list[Transform]:
    if without is not None:
        chain = Chain([t for t in chain.transforms if t.name != without])
    transforms = list(chain.transforms)
    if bits is not None:
        transforms = rewidth(chain, bits)
        if transforms is None:
            raise ValueError(f"{what} ({chain!r}) cannot be stored at {bits:g} bits")
    return _with_meta_dtype(transforms, meta_dtype) if meta_dtype else transforms


def preset_side(spec: str, side: str, chunk: int) -> Chain:
    """The `side` ("keys" or "values") chain of the preset spelled `spec`, for a pipeline of `chunk`-token chunks;
    refused where it is not one chain fitted per sequence or its token group does not divide `chunk`."""
    chain = getattr(from_preset(spec), side)
    if chain.beyond_sequence:
        raise ValueError(f"the {side} of '{spec}' ({chain!r}) hold {chain.beyond_sequence}: take a side that is one "
                         "chain fitted per sequence (kivi-*, frontier-*)")
    if chunk % chain.token_multiple:
        raise ValueError(f"the {side} of '{spec}' quantize groups of {chain.token_multiple} tokens, which do not "
                         f"divide the folder's {chunk}-token chunks: set the preset's group to a divisor of {chunk} "
                         "(kivi-*: group=32)")
    return chain


def override(pipe: KVPipeline, layers: list[int], key_bits: float | None = None, value_bits: float | None = None,
             meta_dtype: str | None = None, without: str | None = None, keys_from: str | None = None,
             values_from: str | None = None) -> KVPipeline:
    """A copy of `pipe` whose `layers` take their keys' chain from the preset `keys_from` and their values' from
    `values_from` (unchanged where None), store keys at `key_bits` and values at `value_bits` bits (unchanged where
    None), their quantizers' metadata as `meta_dtype` (unchanged where None), without the transforms named
    `without`; the model and domain it was tuned for are `pipe`'s. A calibrated `pipe` is refused."""
    changes = (key_bits, value_bits, meta_dtype, without, keys_from, values_from)
    if all(change is None for change in changes):
        raise ValueError("nothing to override: give --key-bits, --value-bits, --meta-dtype, --without, --keys-from "
                         "or --values-from")
    count = (pipe.tuned_for or {}).get("layers")
    outside = [layer for layer in layers if layer < 0 or (count is not None and layer >= count)]
    if outside or not layers:
        raise ValueError(f"layers {outside or layers} are not layers of the model '{pipe.name}' was tuned for "
                         f"({count} layers): give indices from 0")
    if pipe.params():
        raise ValueError(f"pipeline '{pipe.name}' has fitted parameters (calibrated), stored by chain position, "
                         "which new chains would not keep: override a folder that was not calibrated")
    config = pipe.config()
    if any(isinstance(side, dict) for side in (config["keys"], config["values"])) or any(
            isinstance(side, dict) for layer in config["layers"].values() for side in layer.values()):
        raise ValueError(f"pipeline '{pipe.name}' groups its KV heads (tuned --per-head): override per layer only")
    taken = {side: None if spec is None else preset_side(spec, side, pipe.chunk)
             for side, spec in (("keys", keys_from), ("values", values_from))}
    for layer in layers:
        chains = pipe.for_layer(layer)
        keys, values = taken["keys"] or chains.keys, taken["values"] or chains.values
        if without is not None and not any(t.name == without for c in (keys, values) for t in c.transforms):
            raise ValueError(f"layer {layer} has no transform named {without!r} to drop")
        config["layers"][str(layer)] = {
            "keys": Chain(_side(keys, key_bits, meta_dtype, without, f"layer {layer}'s keys")).spec(),
            "values": Chain(_side(values, value_bits, meta_dtype, without, f"layer {layer}'s values")).spec(),
        }
    config["options"] = {**config["options"], "overridden": {
        "layers": layers, **{k: v for k, v in zip(("key_bits", "value_bits", "meta_dtype", "without", "keys_from",
                                                   "values_from"), changes) if v is not None}}}
    out = KVPipeline.from_config(config)  # no fitted parameters to carry: a calibrated pipe was refused above
    out.compile = pipe.compile
    return out


def override_folder(src: Path, out: Path, layers: list[int], **changes) -> KVPipeline:
    """Write to `out` the folder `src` with `layers` overridden (`override`, `changes` its keywords); the pipeline
    written."""
    pipe = override(KVPipeline.from_pretrained(src), layers, **changes)
    save_derived(pipe, src, out)
    return pipe


def _width(text: str) -> int | float:
    """A width as `torchkv tune` spells it: an integer, or a half-bit key width (2.5, 3.5)."""
    value = float(text)
    return int(value) if value.is_integer() else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", required=True, help="comma-separated layer indices, e.g. 5,11,17")
    parser.add_argument("--key-bits", type=_width)
    parser.add_argument("--value-bits", type=_width)
    parser.add_argument("--meta-dtype", choices=("float16", "float8_e5m2", "float8_e4m3fn"))
    parser.add_argument("--without", help="drop the transforms of this name, e.g. balance")
    parser.add_argument("--keys-from", help="take the keys' chain from this preset, e.g. kivi-4bit")
    parser.add_argument("--values-from", help="take the values' chain from this preset, e.g. kivi-4bit:group=128")
    args = parser.parse_args()
    try:
        layers = [int(x) for x in args.layers.split(",")]
        pipe = override_folder(args.src, args.out, layers, key_bits=args.key_bits, value_bits=args.value_bits,
                               meta_dtype=args.meta_dtype, without=args.without, keys_from=args.keys_from,
                               values_from=args.values_from)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {args.out}: layers {layers} overridden ({pipe.options['overridden']})")


if __name__ == "__main__":
    main()
