"""FullPrecisionWindow: the newest tokens of a `KVStore`, held in full precision until whole chunks leave them."""

from collections.abc import Callable

import torch


class FullPrecisionWindow:
    """Key and value buffers `[B, H, capacity, D]`, their validity `[B, capacity]` and, when tracked, the layer
    inputs `[B, capacity, d]`, of which the first `n` slots hold tokens. The capacity grows by doubling, up to
    `max_size` tokens (no bound when None) unless a single write needs more.

    Args:
        max_size: the largest window the store's policy lets it reach (`residual + chunk`, or the window
            policy's `max_window`).
        tracks_input: keep each token's layer input `x` too (XQuant encodes the window from it).
    """

    def __init__(self, max_size: int | None, tracks_input: bool):
        self.max_size, self.tracks_input = max_size, tracks_input
        self.n = 0  # tokens held
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.x: torch.Tensor | None = None

    def reserve(self, k: torch.Tensor, v: torch.Tensor, tokens: int, x: torch.Tensor | None = None) -> None:
        """Make the buffers hold `tokens`; `k, v: [B, H, *, D]` (and `x: [B, *, d]`) give their shapes and dtypes."""
        have = 0 if self.k is None else self.k.shape[2]
        if tokens <= have:
            return
        size = max(tokens, min(2 * have, self.max_size or 2 * have))
        b, h = k.shape[:2]
        grown_k, grown_v = k.new_zeros(b, h, size, k.shape[-1]), v.new_zeros(b, h, size, v.shape[-1])
        grown_valid = torch.zeros(b, size, dtype=torch.bool, device=k.device)
        if have:
            grown_k[:, :, :have], grown_v[:, :, :have], grown_valid[:, :have] = self.k, self.v, self.valid
        self.k, self.v, self.valid = grown_k, grown_v, grown_valid
        if self.tracks_input:
            like = x if self.x is None else self.x
            grown_x = like.new_zeros(b, size, like.shape[-1])
            if have:
                grown_x[:, :have] = self.x
            self.x = grown_x

    def held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`(k, v, valid, x)` of the `n` tokens held (views)."""
        n = self.n
        return self.k[:, :, :n], self.v[:, :, :n], self.valid[:, :n], None if self.x is None else self.x[:, :n]

    def followed_by(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, x: torch.Tensor | None):
        """The held tokens followed by these `[B, H, T, D]`: `(k, v, valid, x)` over `n + T` tokens (new tensors)."""
        if not self.n:
            return k, v, valid, x
        held_k, held_v, held_valid, held_x = self.held()
        x = None if x is None else torch.cat([held_x, x], 1)  # [B, n + T, d]
        return torch.cat([held_k, k], 2), torch.cat([held_v, v], 2), torch.cat([held_valid, valid], 1), x

    def with_new(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The held tokens followed by `k, v: [B, H, T, D]`, written after them but not counted (views)."""
        n, t = self.n, k.shape[2]
        self.reserve(k, v, n + t)
        self.k[:, :, n : n + t], self.v[:, :, n : n + t] = k, v
        return self.k[:, :, : n + t], self.v[:, :, : n + t]

    def count(self, tokens: int, valid: torch.Tensor | None, x: torch.Tensor | None) -> None:
        """Count the `tokens` written after the held ones (`with_new`) as held, with their validity and inputs."""
        n = self.n
        if x is not None:  # the input buffer is sized with the others (`reserve`)
            self.x[:, n : n + tokens] = x
        self.valid[:, n : n + tokens] = True if valid is None else valid
        self.n += tokens

    def hold(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, x: torch.Tensor | None) -> None:
        """Hold exactly these tokens `[B, H, T, D]` (what stays in full precision)."""
        rest = k.shape[2]
        if rest:
            self.reserve(k, v, rest, x)
            self.k[:, :, :rest], self.v[:, :, :rest], self.valid[:, :rest] = k, v, valid
            if x is not None:
                self.x[:, :rest] = x
        self.n = rest

    def tensors(self) -> dict[str, torch.Tensor]:
        """The buffers (allocated capacity included), by the names a store reports them under."""
        named = {"res_k": self.k, "res_v": self.v, "res_x": self.x, "res_valid": self.valid}
        return {name: t for name, t in named.items() if t is not None}

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply `fn` to every buffer (each is indexed by batch row along dim 0)."""
        for name in ("k", "v", "x", "valid"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
