"""Linear layers whose output for one token does not depend on the other tokens of the call.

A matrix product picks its kernel, and with it the order in which it sums over the input features, from the number
of rows M. On this project's CPUs (MKL, float32), M = 1, M = 2..8 and M >= 16 give three different roundings of the
same row, and a row's place in a large product changes it too. So a request in a padded batch gets keys and values
a few float32 rounding steps away from the same request alone, and a 2-bit code or SubKV's window decision can turn that into a whole
rounding step. Computed over fixed blocks of `BLOCK_ROWS` rows, every row goes through the same product of the same
shape wherever it sits, and a request's logits equal its logits alone bit for bit (`torchkv.patch(...,
batch_invariant=True)`; the caches already hold a padded row as it would be alone).
"""

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

#: rows per product: 8 keeps a decode step's 1-row product near its plain cost (SmolLM2's MLP projection on 2 CPU
#: cores: 0.11 ms against 0.07; 0.32 with 32 rows), and a prompt's 4000-row one at about 2.2x (2.1x with 32)
BLOCK_ROWS = 8


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x `[..., K]` and weight `[N, K]`, over blocks of `BLOCK_ROWS` rows of the
    flattened x (the last block zero-padded): `[..., N]`."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    rows = F.pad(rows, (0, 0, 0, -count % BLOCK_ROWS))
    out = torch.cat([F.linear(block, weight, bias) for block in rows.split(BLOCK_ROWS)])
    return out[:count].reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return block_linear(x, self.weight, self.bias)


def make_linears_batch_invariant(model: nn.Module) -> list[nn.Linear]:
    """Give every `nn.Linear` of `model` the blocked forward; returns them (for `restore_linears`)."""
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    if not linears:
        raise ValueError(f"{type(model).__name__} has no torch.nn.Linear layer; batch_invariant=True computes those "
                         "in fixed blocks and cannot change other layer types (drop the option)")
    replaced = [name for name, m in linears.items() if "forward" in vars(m)]
    if replaced:
        raise ValueError(f"the forward of {replaced[0]!r} (and {len(replaced) - 1} more) was already replaced, e.g. "
                         "by accelerate's offloading hooks; batch_invariant=True would drop that: load the model "
                         "without offloading, or drop the option")
    linears = list(linears.values())
    for linear in linears:
        linear.forward = types.MethodType(_forward, linear)
    return linears


def restore_linears(linears: list[nn.Linear]) -> None:
    """Undo `make_linears_batch_invariant`."""
    for linear in linears:
        del linear.forward


@contextlib.contextmanager
def batch_invariant_linears(model: nn.Module) -> Iterator[nn.Module]:
    """`make_linears_batch_invariant` for the body of a `with` block (an unpatched model; `patch` holds its own)."""
    linears = make_linears_batch_invariant(model)
    try:
        yield model
    finally:
        restore_linears(linears)
