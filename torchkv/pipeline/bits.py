"""Stored bits per value, measured on the real state tensors of an encoded chunk."""

import dataclasses

import torch

from torchkv.pipeline.state import LayerState, nbytes, substate


@dataclasses.dataclass(frozen=True)
class BitsPerValue:
    """Measured stored bits per cached value, metadata included."""

    keys: float
    values: float

    @property
    def mean(self) -> float:
        return (self.keys + self.values) / 2


def measure(pipe, kv_heads: int, head_dim: int, seed: int, layer: int) -> BitsPerValue:
    """Stored bits per value of one encoded chunk of Gaussian data of `layer`, by `pipe`'s own chains, measured on
    the real state tensors (metadata included)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, kv_heads, pipe.chunk, head_dim, generator=gen) for _ in range(2))
    inputs = {}
    if {"cos", "sin"} & pipe.requires:  # the identity rotation: position 0 everywhere
        inputs = {"cos": torch.ones(1, pipe.chunk, head_dim), "sin": torch.zeros(1, pipe.chunk, head_dim)}
    if "queries" in pipe.requires:  # one query head per KV head
        inputs["queries"] = torch.randn(1, kv_heads, pipe.chunk, head_dim, generator=gen)
    if "x" in pipe.requires:  # the layer input, as wide as the fitted weights read
        widths = {t.input_width for c in (pipe.keys, pipe.values) for t in c.transforms if "x" in t.requires}
        if None in widths:
            raise ValueError(f"pipeline '{pipe.name}' reads the layer input through weights it has not been "
                             "fitted to; call pipe = pipe.for_model(model) first")
        inputs["x"] = torch.randn(1, pipe.chunk, widths.pop(), generator=gen)
    params = pipe.layer_params(layer)
    device = next((t.device for t in params.values()), torch.device("cpu"))  # fitted on the model's device
    k, v = k.to(device), v.to(device)
    inputs = {n: t.to(device) for n, t in inputs.items()}
    with torch.no_grad():
        prepared = pipe.prepare(k, v, inputs=inputs) if pipe.needs_prepare else {}
        state = pipe.codec.encode(k, v, LayerState(params, prepared, inputs), None)  # eager: accounting only
    n = k.numel()
    return BitsPerValue(8 * nbytes(substate(state, "k.")) / n, 8 * nbytes(substate(state, "v.")) / n)


def bits_per_value(pipeline, kv_heads: int, head_dim: int, seed: int, layers: int | list[int]) -> BitsPerValue:
    """Stored bits per value of one encoded chunk of Gaussian data, measured on the real state tensors and
    averaged over a model's first `layers` layers, or over the layers listed (each encoded by its own chains,
    `layers`); with `layers=1` and per-layer chains, those of the main chains."""
    if layers == 1 and pipeline.layer_chains:
        main = next(i for i in range(len(pipeline.layer_chains) + 1) if i not in pipeline.layer_chains)
        return measure(pipeline, kv_heads, head_dim, seed, main)
    among = range(layers) if isinstance(layers, int) else layers
    measured: dict[int, BitsPerValue] = {}
    per_layer = []
    for i in among:
        pipe = pipeline.for_layer(i)
        if id(pipe) not in measured:
            measured[id(pipe)] = measure(pipe, kv_heads, head_dim, seed, i)
        per_layer.append(measured[id(pipe)])
    return BitsPerValue(sum(b.keys for b in per_layer) / len(among), sum(b.values for b in per_layer) / len(among))
