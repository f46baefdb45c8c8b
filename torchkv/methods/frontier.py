"""Frontier: the composition that measured best on quality, stored bits and decode speed together (issue 19).

Keys are stored after RoPE, so decode attention scores their codes directly instead of rebuilding each
position's key. A key chunk's channels are scaled by `(rms q / rms k)^½` over the prompt and queries by the
inverse (`project.balance`, the scales that minimise the score error of a per-token code: without them Gemma
3's keys cost +32% perplexity at 2.4 bits); then it is vector-quantized with HIGGS (Hadamard rotation, one norm
per row, nearest point of a 4-D Gaussian grid: AQUA-KV §3.3), scored through a per-step look-up table. Values
are Hadamard-rotated and quantized per token and head with the MSE-optimal uniform step for Gaussian rows
(`step="gaussian"`), summed from their codes in the rotated domain and rotated back once per step. The first
`sinks` tokens and a `residual` window stay in full precision, and the first `wide_layers` layers are stored at
`wide_bits` (as AQUA-KV and XQuant-CL widen their first layers). Centring keys by their channels' prompt
medians first (`center`, `predict.center`) is off: on SmolLM2 it gains 0.3 points of perplexity at 2K but
loses 0.7 at 8K and a quarter of the pass-key answers at 4K, because a rotary pair that turns over the context
has no offset that the prompt's median could remove. Choosing key codes under the prompt queries' metric
(`query_metric`) is off too: at 2K / 8K in prompt mode it gains 1.4 / 0.7 points on wiki and loses 0.9 / 3.0 on
code (`benchmarks/results/domains/ablations/`). Centring keys by the prompt's pre-RoPE medians turned to each
position (`rotary_center`, `predict.rotary_center`) is off: at 2K in prompt mode it gains 1.2-1.6 points on
every domain at uniform widths, but tuned per head it loses on code (+2.06% at 8K at 2.5 bits): by the tuner's
measured costs it helps the keys of 18 of SmolLM2's 30 layers and hurts 9. Chosen per head beside uncentred keys
(`benchmarks/reallocate.py --also`) it meets 4% on every domain at 2.1 bits, at 0.64x the CPU decode speed; the GPU
grid kernel adds its offsets per token. Values in HIGGS codes (`values="higgs"`) are off: on Gemma 3 at 2.5 bits,
tuned beside uniform values, they gain 1.3 points on code and lose up to 0.6 on wiki (`benchmarks/results/gemma3/`).
Value scales refitted so that no value row is shrunk (`unbiased_values`, `quantizers.unbiased_scale`) are off: a
nearest-level code with the MSE-optimal step keeps only `1 − MSE` of each row (0.88 at 2 bits, 0.64 at 1), and
attention averages the codes' errors away but not that shrinkage; on Gemma 3's folder held to 2.5 bits they cut the
loss from +2.65 / +3.43 / +3.10% to +1.25 / +2.15 / +1.13% (streaming at 2K, `benchmarks/results/gemma3/`), but on
SmolLM2's per-head folder at 2.5 bits they raise it from +0.12 / +1.04 / +1.22% to +0.71 / +1.20 / +1.54%.
Unbiased keys lose (SmolLM2 `frontier-2bit`, 2K: +2.51 / +8.20 / +7.83% against +1.76 / +5.18 / +6.38%): the
shrinkage cools scores that carry the codes' noise. Values centred by their prompt medians (`value_center`) are
off: on Gemma 3's held folder they lose 0.9-1.8 points on every domain, though they cut the values' error.
Scores less half their codes' expected noise variance (`score_correction`: a noisy score weighs `exp(σ²/2)` more on
average, `HiggsQuantize.token_noise`) are off: they gain on SmolLM2's wiki (3.29 to 1.60% at 8K in prompt mode) and
lose on its code (14.09 to 19.90%) and on every domain of Gemma 3 (2.4-4.4 points streaming at 2K).
The measurements behind each choice are in `benchmarks/results/frontier/` and `benchmarks/results/domains/ablations/`.
"""

import functools

import torchkv.transforms as T
from torchkv.pipeline import KVPipeline
from torchkv.registry import register_preset
from torchkv.transforms.quantizers import higgs_dim

VALUES = ("uniform", "higgs")


def _keys(bits: int | float, dim: int, span: str, center: bool, balance: bool, scale_dtype: str,
          query_metric: bool = False, rotary_center: bool = False, unbiased: bool = False,
          score_correction: bool = False) -> list:
    """Centred (`center`: by a fixed offset; `rotary_center`: by one turned to each position) and balanced HIGGS
    keys on the `dim`-D grid, or the largest grid with `bits` where no `dim`-D one has them (2-D for 2.5 to 4 bits,
    8-D for 1 bit); with `query_metric`, codes chosen under the balanced prompt queries' second moment; with
    `score_correction`, scores less half their codes' noise variance (`HiggsQuantize.token_noise`)."""
    if center and rotary_center:
        raise ValueError("frontier takes center=True or rotary_center=True, not both: each removes the keys' offset")
    if query_metric and not balance:
        raise ValueError("frontier query_metric=True chooses key codes under the balanced prompt queries: it needs "
                         "balance=True")
    dim = higgs_dim(bits, dim) or dim  # no grid has `bits`: the quantizer's error lists the shipped ones
    higgs = T.quantize("higgs", bits=bits, dim=dim, span=span, scale_dtype=scale_dtype, query_metric=query_metric,
                       unbiased=unbiased, score_correction=score_correction)
    return [*([T.predict("center")] if center else []), *([T.predict("rotary_center")] if rotary_center else []),
            *([T.project("balance")] if balance else []), higgs, T.pack()]


def _values(bits: int, kind: str, dim: int, span: str, scale_dtype: str, center: bool, unbiased: bool) -> list:
    """Values, centred by their channels' prompt medians where `center` (decode adds the median back once per step:
    `Σ_t p_t v_t = Σ_t p_t (v_t − μ) + μ·Σ_t p_t`), their scales refitted where `unbiased` (`unbiased_scale`)."""
    if kind == "higgs":  # the ablation: values in HIGGS codes as well
        return _keys(bits, dim, span, center, False, scale_dtype, unbiased=unbiased)
    uniform = T.quantize(bits=bits, axis="token", group=None, symmetric=True, step="gaussian", meta_dtype=scale_dtype,
                         unbiased=unbiased)
    return [*([T.predict("center")] if center else []), T.rotate("hadamard"), uniform, T.pack()]


def frontier(
    bits: int = 2, dim: int = 4, span: str = "head", center: bool = False, balance: bool = True,
    values: str = "uniform", scale_dtype: str = "float16", wide_layers: int = 0, wide_bits: int = 4, sinks: int = 4,
    residual: int = 128, chunk: int = 32, key_bits: int | float | None = None, query_metric: bool = False,
    rotary_center: bool = False, value_center: bool = False, unbiased_values: bool = False,
    score_correction: bool = False,
) -> KVPipeline:
    """Keys: optionally centred (`center`, or `rotary_center` by the prompt's pre-RoPE medians turned to each
    position, an offset decode adds to each token's score), query-balanced (`balance`) post-RoPE HIGGS at
    `key_bits` (default `bits`) on the `dim`-D grid, one norm per `span` ("head": a KV head's features of a token;
    "token": all its KV heads), each code and norm chosen under the balanced prompt queries' second moment where
    `query_metric`; values: optionally centred by their prompt medians (`value_center`), then `values` "uniform"
    (Hadamard, then a Gaussian-step scale per token and head) or "higgs" at `bits`, each scale refitted after the
    codes so that no row is shrunk where `unbiased_values`; scales in `scale_dtype`. With `score_correction`,
    attention subtracts from each encoded key's score half its expected noise variance, `½·mse·‖q‖²·(s/√F)²`
    (`HiggsQuantize.token_noise`): the same stored form and bits."""
    if values not in VALUES:
        raise ValueError(f"frontier values={values!r}; allowed: {VALUES}")

    def chains(width: int, key_width: int) -> tuple[list, list]:
        return (_keys(key_width, dim, span, center, balance, scale_dtype, query_metric, rotary_center,
                      score_correction=score_correction),
                _values(width, values, dim, span, scale_dtype, value_center, unbiased_values))

    keys, vals = chains(bits, bits if key_bits is None else key_bits)
    return KVPipeline(keys, vals, layers=dict.fromkeys(range(wide_layers), chains(wide_bits, wide_bits)),
                      residual=residual, sinks=sinks, chunk=chunk)


PRESETS = {  # name: (nominal bits, options)
    "frontier-2bit": (2.0, {"scale_dtype": "float8_e5m2"}),
    "frontier-2.5bit": (2.5, {"wide_layers": 3}),
    "frontier-3bit": (3.0, {"wide_layers": 11}),
}
for _name, (_bits, _options) in PRESETS.items():
    register_preset(
        _name, nominal_bits=_bits,
        description=f"Frontier {_bits:g}-bit: query-balanced post-RoPE keys in HIGGS 4-D codes, rotated "
                    "Gaussian-step values, both read directly by decode; 4 sinks, fp window",
    )(functools.partial(frontier, **_options))
