"""EncodedChunks: the encoded part of a `KVStore`, the pipeline's state of every chunk that left the window."""

from collections.abc import Callable

import torch


def owned(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied if it is a view into a larger storage (which it would otherwise keep alive)."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def appended(a: torch.Tensor | None, b: torch.Tensor, dim: int) -> torch.Tensor:
    """`b` after `a` along `dim` (`b` alone, owned, when `a` is None)."""
    return owned(b) if a is None else torch.cat([a, b], dim)


class EncodedChunks:
    """Each state tensor `[B, *, rows, ...]` of the pipeline's encode, concatenated along dim 2 over the chunks
    encoded so far; every tensor has a fixed number of rows per encoded token (one, or one per token group).

    Args:
        chunk: tokens per encoded chunk.
    """

    def __init__(self, chunk: int):
        self.chunk = chunk
        self.state: dict[str, torch.Tensor] = {}
        self.n = 0  # tokens encoded

    def extend(self, state: dict[str, torch.Tensor], tokens: int) -> None:
        """Append the state of `tokens` newly encoded tokens (whole chunks)."""
        for name, tensor in state.items():
            self.state[name] = appended(self.state.get(name), tensor, 2)
        self.n += tokens

    def by_chunk(self) -> dict[str, torch.Tensor]:
        """The state viewed by chunk: each `[B, *, rows, ...]` as `[B, *, NC, rows / NC, ...]` (no copy)."""
        chunks = self.n // self.chunk
        return {n: t.unflatten(2, (chunks, t.shape[2] // chunks)) for n, t in self.state.items()}

    def rows_of(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state rows that hold `tokens: [B, N]` (indices among the encoded tokens): each `[B, *, N, ...]`."""
        b, n = tokens.shape
        rows = {}
        for name, t in self.state.items():
            per_row = self.n // t.shape[2]  # tokens per row: 1, or a token group's size
            index = (tokens // per_row).view(b, 1, n, *[1] * (t.dim() - 3)).expand(b, t.shape[1], n, *t.shape[3:])
            rows[name] = t.gather(2, index)
        return rows

    def keep(self, tokens: int) -> None:
        """Keep the first `tokens` encoded tokens, a multiple of the chunk."""
        if self.n:
            self.state = {n: owned(t[:, :, : t.shape[2] * tokens // self.n]) for n, t in self.state.items()}
        self.n = tokens

    def drop_front(self, tokens: int) -> None:
        """Forget the first `tokens` encoded tokens, a multiple of the chunk (their storage goes with them)."""
        self.state = {n: owned(t[:, :, t.shape[2] * tokens // self.n :]) for n, t in self.state.items()}
        self.n -= tokens

    def bits_per_value(self, kv_heads: int, head_dim: int) -> float:
        """Stored bits per encoded key or value, metadata included; NaN when nothing is encoded."""
        if not self.n:
            return float("nan")
        batch = next(iter(self.state.values())).shape[0]
        values = 2 * self.n * batch * kv_heads * head_dim
        return 8 * sum(t.numel() * t.element_size() for t in self.state.values()) / values

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply `fn` to every state tensor (each is indexed by batch row along dim 0)."""
        self.state = {n: fn(t) for n, t in self.state.items()}
