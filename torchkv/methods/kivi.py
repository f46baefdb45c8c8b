"""KIVI (Liu et al., 2024): keys quantized per channel, values per token, recent tokens in full precision.

Also the `fp16` reference preset: the whole cache stored in half precision, nothing else.
"""

import torchkv.transforms as T
from torchkv.pipeline import KVPipeline
from torchkv.registry import register_preset


def kivi(bits: int, group: int = 32, residual: int = 128, sinks: int = 0, values: int | None = None) -> KVPipeline:
    """Keys: asymmetric per-channel groups of `group` tokens; values: per-token groups of `group` channels
    at `values` bits (default: `bits`; 16 stores them in float16, as SVDq's comparison needs)."""
    values = bits if values is None else values
    return KVPipeline(
        keys=[T.quantize(bits=bits, axis="channel", group=group), T.pack()],
        values=[T.quantize("cast", dtype="float16")] if values == 16
        else [T.quantize(bits=values, axis="token", group=group), T.pack()],
        residual=residual,
        sinks=sinks,
    )


@register_preset("kivi-2bit", description="KIVI 2-bit: per-channel keys, per-token values, fp window", nominal_bits=2.0)
def kivi_2bit(group: int = 32, residual: int = 128, sinks: int = 0, values: int = 2) -> KVPipeline:
    return kivi(2, group, residual, sinks, values)


@register_preset("kivi-4bit", description="KIVI 4-bit: per-channel keys, per-token values, fp window", nominal_bits=4.0)
def kivi_4bit(group: int = 32, residual: int = 128, sinks: int = 0, values: int = 4) -> KVPipeline:
    return kivi(4, group, residual, sinks, values)


@register_preset("kivi-8bit", description="KIVI 8-bit: per-channel keys, per-token values, fp window", nominal_bits=8.0)
def kivi_8bit(group: int = 32, residual: int = 128, sinks: int = 0, values: int = 8) -> KVPipeline:
    return kivi(8, group, residual, sinks, values)


@register_preset("fp16", description="No compression: the whole cache stored in float16 (reference)", nominal_bits=16.0)
def fp16() -> KVPipeline:
    return KVPipeline(
        keys=[T.quantize("cast", dtype="float16")],
        values=[T.quantize("cast", dtype="float16")],
        residual=0,
    )
