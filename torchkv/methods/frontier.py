"""Frontier: the composition that measured best on quality, stored bits and decode speed together (issue 19).

Keys are stored after RoPE, so decode attention scores their codes directly instead of rebuilding each
position's key: a key chunk is centred by its channels' medians over the prompt (`predict.center`) and
vector-quantized with HIGGS (Hadamard rotation, one norm per row, nearest point of a 4-D Gaussian grid:
AQUA-KV §3.3), scored through a per-step look-up table. Values are Hadamard-rotated and quantized per token
and head with the MSE-optimal uniform step for Gaussian rows (`step="gaussian"`), summed from their codes in the
rotated domain and rotated back once per step. The first `sinks` tokens and a `residual` window stay in full
precision, and the first `wide_layers` layers are stored at `wide_bits` (as AQUA-KV and XQuant-CL widen their
first layers). The measurements behind each choice are in `benchmarks/results/frontier/`.
"""

import functools

import torchkv.transforms as T
from torchkv.pipeline import KVPipeline
from torchkv.registry import register_preset
from torchkv.transforms.quantizers import HIGGS_SHAPES

VALUES = ("uniform", "higgs")


def _keys(bits: int, dim: int, span: str, center: bool, scale_dtype: str) -> list:
    """Centred HIGGS keys on the `dim`-D grid, or the 2-D one where no `dim`-D grid has `bits` (4 bits)."""
    dim = dim if (bits, dim) in HIGGS_SHAPES else 2
    higgs = T.quantize("higgs", bits=bits, dim=dim, span=span, scale_dtype=scale_dtype)
    return [*([T.predict("center")] if center else []), higgs, T.pack()]


def _values(bits: int, kind: str, dim: int, span: str, scale_dtype: str) -> list:
    if kind == "higgs":  # the ablation: values in HIGGS codes as well
        return _keys(bits, dim, span, False, scale_dtype)
    uniform = T.quantize(bits=bits, axis="token", group=None, symmetric=True, step="gaussian", meta_dtype=scale_dtype)
    return [T.rotate("hadamard"), uniform, T.pack()]


def frontier(
    bits: int = 2, dim: int = 4, span: str = "head", center: bool = True, values: str = "uniform",
    scale_dtype: str = "float16", wide_layers: int = 0, wide_bits: int = 4, sinks: int = 4, residual: int = 128,
    chunk: int = 32,
) -> KVPipeline:
    """Keys: centred post-RoPE HIGGS at `bits` on the `dim`-D grid, one norm per `span` ("head": a KV head's
    features of a token; "token": all its KV heads); values: `values` "uniform" (Hadamard, then a Gaussian-step
    scale per token and head) or "higgs"; scales stored in `scale_dtype`."""
    if values not in VALUES:
        raise ValueError(f"frontier values={values!r}; allowed: {VALUES}")

    def chains(width: int) -> tuple[list, list]:
        return (_keys(width, dim, span, center, scale_dtype), _values(width, values, dim, span, scale_dtype))

    keys, vals = chains(bits)
    return KVPipeline(keys, vals, first_layers=[chains(wide_bits)] * wide_layers or None, residual=residual,
                      sinks=sinks, chunk=chunk)


PRESETS = {  # name: (nominal bits, options)
    "frontier-2bit": (2.0, {"span": "token", "scale_dtype": "float8_e5m2"}),
    "frontier-2.5bit": (2.5, {"wide_layers": 3}),
    "frontier-3bit": (3.0, {"wide_layers": 11}),
}
for _name, (_bits, _options) in PRESETS.items():
    register_preset(
        _name, nominal_bits=_bits,
        description=f"Frontier {_bits:g}-bit: centred post-RoPE keys in HIGGS 4-D codes, rotated Gaussian-step "
                    "values, both read directly by decode; 4 sinks, fp window",
    )(functools.partial(frontier, **_options))
