"""Flat state dicts: the tensors of a chain's transforms travel under prefixes ("k.", "v.", "{i}.")."""

from collections.abc import Mapping

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
