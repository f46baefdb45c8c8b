"""TrackedPositions: the position id of every token a store holds, for pipelines that store keys before RoPE."""

from collections.abc import Callable

import torch

from torchkv.encoded import appended, owned

#: positions [B, T] -> (cos, sin) [B, T, R]: the model's rotary embedding of those positions.
RopeFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class TrackedPositions:
    """Position ids `[B, length]` of the tokens held, in sequence order, and the rotary embedding of any of them
    (what transforms that require "cos"/"sin" read).

    Args:
        rope: the model's rotary embedding.
    """

    def __init__(self, rope: RopeFn):
        self.rope = rope
        self.ids: torch.Tensor | None = None

    def extend(self, positions: torch.Tensor | None, batch: int, tokens: int, device: torch.device) -> None:
        """Keep `tokens` new tokens' position ids `[B or 1, T]` (default: their index in the sequence)."""
        held = 0 if self.ids is None else self.ids.shape[1]
        if positions is None:
            positions = torch.arange(held, held + tokens, device=device)[None]
        self.ids = appended(self.ids, positions.expand(batch, tokens).long(), 1)

    def rope_inputs(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """`{"cos", "sin"}` of the tokens held at indices [start, end)."""
        cos, sin = self.rope(self.ids[:, start:end])
        return {"cos": cos, "sin": sin}

    def rope_at(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """`{"cos", "sin"}` of the tokens held at `index: [B, N]`."""
        cos, sin = self.rope(self.ids.gather(1, index))
        return {"cos": cos, "sin": sin}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.ids is None else {"positions": self.ids}

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.ids is not None:
            self.ids = fn(self.ids)

    def keep(self, tokens: int) -> None:
        """Keep the first `tokens` ids."""
        if self.ids is not None:
            self.ids = owned(self.ids[:, :tokens])
