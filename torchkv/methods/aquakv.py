"""AQUA-KV (Shutova et al., 2025): predict each layer's keys and values from reconstructions the decoder
already holds, and quantize only the residual with HIGGS.

Layer ℓ ≥ 1 (Alg. 2/3): keys `K̂_ℓ = f_K(K̂_{ℓ−1}) + Q̃(K_ℓ − f_K(K̂_{ℓ−1}))`, pre-RoPE; values
`V̂_ℓ = f_V([K̂_ℓ ; V̂_{ℓ−1}]) + Q̃(V_ℓ − f_V(·))`. The predictors `f` are linear with bias, fitted in closed
form by ridge regression one layer after another on reconstructed inputs (`pipe.fit(model, texts)` or
`torchkv calibrate`, see `torchkv.fitting.calibrate`); `Q̃` is HIGGS (Hadamard rotation, L2-norm scale,
nearest point of a Gaussian-optimal 2-D grid). Layer 0 has no previous layer: it is quantized directly at
`first_bits`. The first `sinks` tokens and a `residual` window stay in full precision.
"""

import functools

import torchkv.transforms as T
from torchkv.pipeline import KVPipeline
from torchkv.registry import register_preset

PREDICTORS = ("both", "keys", "none")
FIRST_BITS = (2, 3, 4, 16)


def aquakv(
    bits: int, predictors: str = "both", first_bits: int = 4, span: str = "head", residual: int = 128,
    sinks: int = 4, chunk: int = 32,
) -> KVPipeline:
    """AQUA-KV at `bits` per value: `predictors` "both" (the method), "keys" (no value predictor) or "none"
    (HIGGS alone, the paper's ablation); layer 0 at `first_bits` HIGGS, or 16 for float16; `span` of one
    HIGGS scale: "head" (a KV head's features of a token) or "token" (all its KV heads)."""
    if predictors not in PREDICTORS:
        raise ValueError(f"aquakv predictors={predictors!r}; allowed: {PREDICTORS}")
    if first_bits not in FIRST_BITS:
        raise ValueError(f"aquakv first_bits={first_bits!r}; allowed: {FIRST_BITS} (16 keeps layer 0 in float16)")

    def higgs(width: int) -> list:
        return [T.quantize("cast", dtype="float16")] if width == 16 else [T.quantize("higgs", bits=width, span=span), T.pack()]

    key_predictor = [T.predict("linear", sources=("previous",))] if predictors != "none" else []
    value_predictor = [T.predict("linear", sources=("keys", "previous"))] if predictors == "both" else []
    return KVPipeline(
        keys=[T.rotate("pre_rope"), *key_predictor, *higgs(bits)],
        values=[*value_predictor, *higgs(bits)],
        layers={0: ([T.rotate("pre_rope"), *higgs(first_bits)], higgs(first_bits))},
        residual=residual,
        sinks=sinks,
        chunk=chunk,
    )


for _bits in (2, 3):
    register_preset(
        f"aquakv-{_bits}bit", nominal_bits=float(_bits),
        description=f"AQUA-KV {_bits}-bit: cross-layer predictors + HIGGS residuals (calibrate first)",
    )(functools.partial(aquakv, _bits))
register_preset("aquakv-2bit-keys", description="AQUA-KV 2-bit ablation: key predictor only (calibrate first)",
                nominal_bits=2.0)(functools.partial(aquakv, 2, "keys"))
register_preset("aquakv-2bit-nopred", description="AQUA-KV 2-bit ablation: HIGGS without predictors (no calibration)",
                nominal_bits=2.0)(functools.partial(aquakv, 2, "none"))
