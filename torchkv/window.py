"""Window policies: when the full-precision window of a `KVStore` is full, flush it or let it grow.

Without a policy, a window that reaches `residual + chunk` tokens flushes its oldest whole chunks.
`DynamicWindow` is SubKV's rule (§3.5; spec §3.3 step 4 with decisions A4–A8): at that moment the
newest query's attention decides instead. `PromptOnly` compresses the prompt and keeps every later
token in full precision (SVDq's generated tokens, spec S7).
"""

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class DynamicWindow:
    """Grow the full window by one token, instead of flushing it, while its oldest token receives at
    least as much attention from the newest query as that query's own token (ties grow, A8); the
    probabilities are averaged over batch rows and query heads first (one decision per layer, A7).

    The window never grows past `max_window` tokens (the paper's window grows without bound, A4),
    nor shrinks back after a flush (paper-literal A4).
    """

    max_window: int
    #: the store passes each new token's attention probabilities of the full-precision tokens
    reads_attention: ClassVar[bool] = True
    compresses_after_prompt: ClassVar[bool] = True

    def __post_init__(self):
        if not isinstance(self.max_window, int) or self.max_window < 1:
            raise ValueError(f"max_window={self.max_window!r} must be a positive integer (tokens)")

    def grows(self, p_edge: float, p_new: float, limit: int) -> bool:
        """Whether a full window of `limit` tokens grows, given the mean attention probability of its
        oldest token (`p_edge`) and of the newest token (`p_new`)."""
        return p_edge >= p_new and limit < self.max_window

    def flushed(self, attention: list[list[float]], held: int, sinks: int, limit: int, residual: int, chunk: int
                ) -> tuple[int, int]:
        """`(tokens to encode from the front, the new limit)` of a window of `held` tokens and `limit`, as new
        tokens enter it one at a time. `attention[i]` is new token i's attention row over the sinks, the window
        and the new tokens; each time the window is full, that row decides whether it grows or flushes."""
        flushed = 0
        for i, row in enumerate(attention):
            n = held + i + 1 - flushed
            if n < limit:
                continue
            if self.grows(row[sinks + flushed], row[sinks + held + i], limit):
                limit += 1
            else:
                flushed += (n - residual) // chunk * chunk
        return flushed, limit

    def spec(self) -> dict[str, Any]:
        return {"policy": "dynamic", "max_window": self.max_window}



@dataclass(frozen=True)
class PromptOnly:
    """The prompt's chunks are encoded as usual; every token appended after the prompt stays in the
    (unbounded) full-precision window."""

    max_window: ClassVar[None] = None
    reads_attention: ClassVar[bool] = False
    compresses_after_prompt: ClassVar[bool] = False

    def spec(self) -> dict[str, Any]:
        return {"policy": "prompt_only"}


WindowPolicy = DynamicWindow | PromptOnly


def from_spec(spec: dict[str, Any]) -> WindowPolicy:
    """The policy a `spec()` describes (what `KVPipeline.from_pretrained` reads)."""
    if spec.get("policy") == "dynamic":
        return DynamicWindow(spec["max_window"])
    if spec.get("policy") == "prompt_only":
        return PromptOnly()
    raise ValueError(f"unknown window policy {spec!r}; known: 'dynamic', 'prompt_only'")
