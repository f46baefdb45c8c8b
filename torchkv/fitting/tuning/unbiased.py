"""A tuned pipeline read with its value scales refitted after their codes (`unbiased`), its widths unchanged.

Tuning measures each value width with MSE-optimal scales, whose codes shrink a row by about its relative error (a
third at 1 bit). Refitting each token's scale so that `v·v̂ = ‖v‖²` (`quantizers.unbiased_scale`) removes the
shrinkage but enlarges each row's error, and which costs more differs by model: Gemma 3's folder tuned to 2.5 bits
lost +1.25 / +2.15 / +1.13% streaming at 2K (wiki / code / docs) read unbiased, against +2.65 / +3.43 / +3.10%;
SmolLM2's per-head folder +0.71 / +1.20 / +1.54% against +0.12 / +1.04 / +1.22% (`benchmarks/results/`). Keys
keep their MSE-optimal scales: unbiased, they lost on SmolLM2.
"""

from torchkv.pipeline import KVPipeline


def unbiased_values(pipe: KVPipeline, max_bits: float | None = None) -> tuple[KVPipeline, int]:
    """A copy of `pipe` with its value quantizers of at most `max_bits` bits (every one where None) set `unbiased`,
    and how many quantizers its config sets (layers with equal chains count each). The copy's `options` record
    `unbiased_values`; its fitted parameters and the model and domains it was tuned for are `pipe`'s."""
    config = pipe.config()
    sides = [config["values"], *(layer["values"] for layer in config["layers"].values())]
    chains = [c for side in sides for c in (side["chains"] if isinstance(side, dict) else [side])]  # head groups
    quantizers = [t for chain in chains for t in chain if t["kind"] == "quantize"
                  and (max_bits is None or t["config"]["bits"] <= max_bits)]
    if not quantizers:
        raise ValueError(f"pipeline '{pipe.name}' has no value quantizer to unbias"
                         + ("" if max_bits is None else f" of at most {max_bits:g} bits"))
    for t in quantizers:
        t["config"]["unbiased"] = True
    config["options"] = {**config["options"],
                         "unbiased_values": True if max_bits is None else f"up to {max_bits:g} bits"}
    try:
        out = KVPipeline.from_config(config)
    except ValueError as err:  # a quantizer that cannot refit its scale (asymmetric or per-channel codes)
        raise ValueError(f"pipeline '{pipe.name}': its values cannot be read unbiased ({err})") from None
    out.load_params(pipe.params())
    out.compile = pipe.compile
    return out, len(quantizers)
