"""The mask function torchkv registers with transformers, and the mask description it returns.

The mask function does not build a mask: it returns a `MaskSpec` (the model's mask rule plus the padding mask and
query offset), from which attention builds a FlexAttention `BlockMask` for a prompt or a small dense mask for decode,
over the absolute positions of the cached tokens.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from transformers.masking_utils import causal_mask_function


@dataclass(frozen=True)
class MaskSpec:
    """The attention mask of one forward pass, in absolute token positions.

    Attributes:
        rule: transformers' mask function `(b, h, q_pos, kv_pos) -> bool` (causal, sliding, ...).
        padding: [B, kv_length] bool, False at padding, or None when nothing is padded.
        q_offset: absolute position index of the first query.
        kv_start: absolute index of the first key the attention reads (`after`): a sliding-window layer's store
            drops the tokens before it.
    """

    rule: Callable
    padding: torch.Tensor | None
    q_offset: "int | torch.Tensor"  # a 0-d tensor only inside a compiled step (read by no compiled path)
    _dense: dict = field(default_factory=dict, compare=False, repr=False)  # every layer asks for the same
    kv_start: int = 0
    #: transformers passes a prepared mask of 4 dimensions through its mask creation unchanged; a spec made
    #: outside a compiled step (by `generate`, for compileable caches) reaches the attention function the same way
    ndim: ClassVar[int] = 4

    @property
    def causal(self) -> bool:
        """The plain causal rule with no padding (what `is_causal` kernels implement)."""
        return self.rule is causal_mask_function and self.padding is None and not self.kv_start

    def after(self, dropped: int) -> "MaskSpec":
        """This spec over keys from absolute index `dropped` on (a store that dropped its first tokens); it shares
        the dense masks every layer asks for."""
        return self if not dropped else MaskSpec(self.rule, self.padding, self.q_offset, self._dense, dropped)

    @property
    def extra_rule(self) -> Callable | None:
        """The mask rule, or None for the plain causal one (under which every held token is visible to a new one)."""
        return None if self.rule is causal_mask_function else self.rule

    def dense(self, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
        """[B or 1, 1, Q, N] bool, by broadcasting the rule over index grids (computed once per forward)."""
        key = (q_len, kv_len, str(device), self.kv_start)
        if key not in self._dense:
            q = torch.arange(self.q_offset, self.q_offset + q_len, device=device)[None, None, :, None]
            kv = torch.arange(self.kv_start, self.kv_start + kv_len, device=device)[None, None, None, :]
            batch = 1 if self.padding is None else self.padding.shape[0]
            b = torch.arange(batch, device=device)[:, None, None, None]
            allowed = self.rule(b, torch.zeros_like(b), q, kv)
            if self.padding is not None:
                allowed = allowed & self.padding[:, None, None, self.kv_start : self.kv_start + kv_len]
            self._dense[key] = allowed.expand(batch, 1, q_len, kv_len)
        return self._dense[key]

    def mask_mod(self, device: torch.device, q_start: int = 0, kv_start: int = 0, padded: bool = False) -> Callable:
        """A FlexAttention mask_mod for queries from index `q_start` and keys from index `kv_start` (both counted from
        the first query and the first key read, `self.kv_start`).

        With `padded`, keys are also checked against the padding mask (indexed by batch row).
        """
        # tensors, so new offsets do not recompile
        q_off = torch.tensor(self.q_offset + q_start, device=device)
        kv_off = torch.tensor(self.kv_start + kv_start, device=device)
        rule, padding = self.rule, self.padding

        if not padded:

            def cached_causal(b, h, q_idx, kv_idx):
                return rule(b, h, q_idx + q_off, kv_idx + kv_off)

            return cached_causal

        def cached_causal_padded(b, h, q_idx, kv_idx):
            return rule(b, h, q_idx + q_off, kv_idx + kv_off) & padding[b, kv_idx + kv_off]

        return cached_causal_padded

    def left_padding(self) -> list[int] | None:
        """Pad count of each row when every row is pads then tokens (left padding), else None."""
        if self.padding is None:
            raise ValueError("no padding")
        starts = self.padding.int().argmax(-1)
        rows = torch.arange(self.padding.shape[-1], device=self.padding.device)[None]
        is_left = torch.equal(self.padding, rows >= starts[:, None])
        return starts.tolist() if is_left else None

    def trailing_padding(self, kv_len: int) -> list[int] | None:
        """Pad count after each row's last real token among the first `kv_len` positions (right-padded queries, as
        the lm-eval scorer's continuations), or None when no row has any."""
        if self.padding is None or torch.compiler.is_compiling():
            return None
        key = ("trailing", kv_len, self.kv_start)
        if key not in self._dense:  # every layer asks the same
            after = self.padding[:, self.kv_start : self.kv_start + kv_len].flip(-1).int().cummax(-1).values == 0
            self._dense[key] = after.sum(-1).tolist() if bool(after.any()) else None
        return self._dense[key]

    def check_storable(self, q_len: int, fresh: bool) -> None:
        """Refuse padding a torchkv cache cannot hold as each row would be held alone: a row that is all padding,
        padding between real tokens, or (on a `fresh` cache) padding after a row's tokens. Checked once per spec."""
        if self.padding is None or "checked" in self._dense:
            return
        self._dense["checked"] = True
        real = self.padding[:, : int(self.q_offset) + q_len]
        empty = (~real.any(-1)).nonzero()[:, 0].tolist()
        if empty:
            raise ValueError(f"row(s) {empty} of the attention mask are all padding: a torchkv cache holds each row's "
                             "own tokens and these have none; remove them from the batch")
        started = real.int().cummax(-1).values.bool()  # from each row's first real token on
        pads_after = started & ~real
        holes = pads_after & real.flip(-1).int().cummax(-1).values.flip(-1).bool()  # before a later real token
        if holes.any() or (fresh and pads_after.any()):
            rows = (holes.any(-1) | pads_after.any(-1)).nonzero()[:, 0].tolist()
            raise ValueError(
                f"row(s) {rows} of the attention mask have padding after real tokens ("
                f"{'padding between tokens' if holes.any() else 'right padding'}); torchkv caches take left-padded "
                "batches, pads first then each row's tokens: pad on the left (tokenizer.padding_side = 'left')")

    def for_rows(self, rows: torch.Tensor, strip: int, first_query: int) -> "MaskSpec":
        """The spec of the queries from `first_query` on of batch rows `rows`, in positions that start after the
        rows' first `strip` (the rule is shift-invariant: causal or sliding)."""
        padding = None if self.padding is None else self.padding[rows.to(self.padding.device), strip:]
        return MaskSpec(self.rule, padding, self.q_offset + first_query - strip)

    def valid(self, start: int, end: int) -> torch.Tensor | None:
        """[B, end - start] bool validity of the tokens at positions [start, end), or None."""
        return None if self.padding is None else self.padding[:, start:end]


def torchkv_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> MaskSpec:
    """The function registered with `AttentionMaskInterface`: returns the mask's description.

    Inside a compiled step nothing reads tensor values: the padding mask is kept even when it masks nothing, and
    a tensor `q_offset` (compileable caches report their length as one) stays a tensor."""
    if isinstance(attention_mask, MaskSpec):  # made before the compiled step (see `MaskSpec.ndim`)
        return attention_mask
    if kv_offset:
        raise ValueError("torchkv caches give masks over absolute token indices (a store that dropped tokens reads "
                         "its part); a non-zero kv_offset means a foreign cache layer")
    compiling = torch.compiler.is_compiling()
    if not (compiling and isinstance(q_offset, torch.Tensor)):
        q_offset = int(q_offset)
        if q_offset + q_length > kv_length:  # only a fixed-capacity cache reports fewer
            raise ValueError(
                f"the cache holds at most {kv_length} tokens (max_cache_len) and would hold {q_offset + q_length}: "
                "create it with a larger max_cache_len (generate sizes it from max_new_tokens with "
                "cache_implementation='static')"
            )
    padding = None
    if attention_mask is not None and (compiling or not bool(attention_mask.all())):
        # positions past the mask are tokens still to come
        padding = F.pad(attention_mask, (0, max(0, kv_length - attention_mask.shape[-1])), value=True)
    return MaskSpec(mask_function, padding, q_offset)
