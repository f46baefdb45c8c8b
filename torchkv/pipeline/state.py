"""What encoding and decoding read besides the tokens: flat dicts whose names carry prefixes ("k.", "v." for the two
chains, "{i}." for a chain's transforms), travelling together as one `LayerState`."""

from collections.abc import Mapping
from typing import NamedTuple

import torch


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes the tensors hold."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def substate(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Entries of `state` under `prefix`, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def prefixed(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Entries of `state` with `prefix` before each name."""
    return {prefix + k: v for k, v in state.items()}


class LayerState(NamedTuple):
    """One layer's tensors that encode, decode and decode attention read besides the tokens.

    Attributes:
        params: the layer's fitted parameters, "k.{i}.{name}" / "v.{i}.{name}" (a chain's own: "{i}.{name}").
        prepared: per-sequence state from the prompt (SVDq's basis, SQuat's subspace), named the same way.
        inputs: model-side tensors of the tokens ("cos"/"sin", "queries", "x"; across layers "previous.k"/"previous.v",
            in a chain's own "previous" and "keys").
    """

    params: Mapping[str, torch.Tensor]
    prepared: Mapping[str, torch.Tensor]
    inputs: Mapping[str, torch.Tensor]


def side_of(layer: LayerState, side: str, inputs: Mapping[str, torch.Tensor] | None = None) -> LayerState:
    """One chain's view ("k" or "v"): its params and prepared state with the prefix removed, and `inputs` instead
    of the layer's where given (cross-layer pipelines give each chain its own)."""
    return LayerState(substate(layer.params, f"{side}."), substate(layer.prepared, f"{side}."),
                      layer.inputs if inputs is None else inputs)
