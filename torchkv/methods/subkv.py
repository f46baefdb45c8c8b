"""SubKV (Zeng et al., 2025): KIVI-style keys per channel and values per token, the first (sink) token
kept in full precision, and a dynamic full-precision window.

The window fills up to `window` = N recent tokens (N = 32, a multiple of the group G); when it is full,
its oldest tokens are quantized in whole N-token chunks unless the newest query pays the oldest window
token at least as much attention as itself, in which case the window grows by one token instead
(`torchkv.window.DynamicWindow`, bounded by `max_window`). Keys and values always leave the window
together (spec A6), and a flush of a grown window keeps the tokens past its last whole chunk in full
precision (spec A5, with chunks of N rather than G tokens; the same at N = G): no token is dropped.
`sink=False` and `dynamic=False` are the paper's ablations; with both off this is KIVI with a
0…N-1 token window.
"""

import torchkv.transforms as T
from torchkv.pipeline import KVPipeline
from torchkv.registry import register_preset
from torchkv.window import DynamicWindow


def subkv(
    bits: int, group: int = 32, window: int = 32, sink: bool = True, dynamic: bool = True, max_window: int = 128
) -> KVPipeline:
    """Keys: per-channel groups of `group` tokens; values: per-token groups of `group` channels (Eq. 4)."""
    if not isinstance(window, int) or window < group or window % group:
        raise ValueError(f"window={window!r} must be a positive multiple of group={group} (whole key blocks flush)")
    return KVPipeline(
        keys=[T.quantize(bits=bits, axis="channel", group=group), T.pack()],
        values=[T.quantize(bits=bits, axis="token", group=group), T.pack()],
        residual=0,
        chunk=window,
        sinks=1 if sink else 0,
        window=DynamicWindow(max_window) if dynamic else None,
    )


@register_preset(
    "subkv-2bit", description="SubKV 2-bit: KIVI grouping, fp sink token, attention-driven dynamic window",
    nominal_bits=2.0,
)
def subkv_2bit(
    group: int = 32, window: int = 32, sink: bool = True, dynamic: bool = True, max_window: int = 128
) -> KVPipeline:
    return subkv(2, group, window, sink, dynamic, max_window)


@register_preset(
    "subkv-4bit", description="SubKV 4-bit: KIVI grouping, fp sink token, attention-driven dynamic window",
    nominal_bits=4.0,
)
def subkv_4bit(
    group: int = 32, window: int = 32, sink: bool = True, dynamic: bool = True, max_window: int = 128
) -> KVPipeline:
    return subkv(4, group, window, sink, dynamic, max_window)
