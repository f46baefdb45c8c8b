"""TrackedPositions: the position id of every token a store holds, for pipelines that read positions (keys stored
before RoPE, a centre turned to each position); SharedRope: what the layers of one cache share of them."""

from collections.abc import Callable

import torch

from torchkv.encoded import appended, owned

#: positions [B, T] -> (cos, sin) [B, T, R]: the model's rotary embedding of those positions.
RopeFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def chunk_anchors(ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """`[B, NC]`: each chunk's anchor, the first position of `ids [B, NC·chunk]` taken as its last token's less
    `chunk − 1` (left padding comes first)."""
    return ids[:, chunk - 1 :: chunk] - (chunk - 1)


def run_from(anchors: torch.Tensor, chunk: int) -> torch.Tensor:
    """`[B, NC, chunk]`: the positions of chunks whose positions run on by one from `anchors [B, NC]`."""
    return anchors[..., None] + torch.arange(chunk, device=anchors.device)


def step_tables(rope: RopeFn, chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) `[1, chunk, R]` float32 of positions 0..chunk−1 over the table's value at 0: the steps within a chunk
    of `ops.rope.turned_dot_by_chunk`, without the model's attention scaling (which the anchors' tables carry)."""
    cos, sin = rope(torch.arange(chunk, device=device)[None])
    scale = cos[:, :1].float()
    return cos.float() / scale, sin.float() / scale


class SharedRope:
    """A model's rotary embedding as the stores of one cache's layers that use it call it.

    The layers hold the same tokens at the same positions, so what each would compute alone is computed once a step:
    - `extended`: the position ids after a step's tokens, one tensor for every layer that held the same ids before and
      is given the same new positions (the model passes one `position_ids` tensor to every layer);
    - `dropped`: the same after the first ids are dropped (the sliding-window layers drop the same tokens);
    - `tables`: the cos/sin of a range of those ids, the last `KEPT` ranges kept until `release` (the cache releases
      them after its last layer, so that an idle cache holds none);
    - `chunk_tables`: the same of a range's chunks, by each chunk's first position (`ops.rope.turned_dot_by_chunk`);
    - `runs_by_chunk`: whether a range's tokens sit where those tables put them, checked once for every layer.

    They match by identity only (which ids tensor, which positions tensor), never by value: nothing is read back from
    the device but `runs_by_chunk`'s one flag, and a layer whose ids differ (a beam reorder, a crop) computes its own,
    as it would alone.

    Args:
        rope: the model's rotary embedding.
    """

    #: tables kept: a step asks for two ranges, the encoded tokens (decode attention) and, when the window flushes,
    #: the chunk it encodes
    KEPT = 2

    def __init__(self, rope: RopeFn):
        self.rope = rope
        #: (ids before, positions given, (batch, tokens, device, dropped), ids after)
        self._extended: tuple | None = None
        self._dropped: tuple | None = None  # (ids before, tokens dropped, ids after)
        self._tables: list[tuple] = []  # (ids, (start, end) or (start, end, chunk), tables), the newest last
        self._steps: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (chunk, device) -> step tables
        self._checked: tuple | None = None  # (ids, (start, end, chunk), whether they run by chunk)

    def extended(self, ids: torch.Tensor | None, positions: torch.Tensor | None, batch: int, tokens: int,
                 device: torch.device, dropped: int = 0) -> torch.Tensor:
        """`ids [B, held]` followed by `tokens` new ids: `positions [B or 1, T]`, or by default their index in the
        sequence (`dropped` tokens came before the held ones)."""
        if self._extended is not None:
            before, given, shape, after = self._extended
            if before is ids and given is positions and shape == (batch, tokens, device, dropped):
                return after
        first = dropped + (0 if ids is None else ids.shape[1])
        new = torch.arange(first, first + tokens, device=device)[None] if positions is None else positions
        after = appended(ids, new.expand(batch, tokens).long(), 1)
        self._extended = (ids, positions, (batch, tokens, device, dropped), after)
        return after

    def dropped(self, ids: torch.Tensor, tokens: int) -> torch.Tensor:
        """`ids [B, held]` without their first `tokens`."""
        if self._dropped is None or self._dropped[0] is not ids or self._dropped[1] != tokens:
            self._dropped = (ids, tokens, owned(ids[:, tokens:]))
        return self._dropped[2]

    def tables(self, ids: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) `[B, end - start, R]` of `ids[:, start:end]`."""
        return self._kept(ids, (start, end), lambda: self.rope(ids[:, start:end]))

    def chunk_tables(self, ids: torch.Tensor, start: int, end: int, chunk: int) -> dict[str, torch.Tensor]:
        """The rotary tables of `ids[:, start:end]` (whole chunks of `chunk` tokens) by chunk: "anchor_cos"/"anchor_sin"
        `[B, NC, R]` of each chunk's first position, taken as its last token's position less `chunk − 1` (left
        padding comes first), and "step_cos"/"step_sin" `[1, chunk, R]` of positions 0..chunk−1 over the table's
        value at 0 (the attention scaling, which the anchors carry). Exact where `runs_by_chunk`."""
        def anchored():
            return self.rope(chunk_anchors(ids[:, start:end], chunk))

        anchor_cos, anchor_sin = self._kept(ids, (start, end, chunk), anchored)
        key = (chunk, ids.device)
        if key not in self._steps:
            self._steps[key] = step_tables(self.rope, chunk, ids.device)
        step_cos, step_sin = self._steps[key]
        return {"anchor_cos": anchor_cos, "anchor_sin": anchor_sin, "step_cos": step_cos, "step_sin": step_sin}

    def runs_by_chunk(self, ids: torch.Tensor, start: int, end: int, chunk: int, valid: torch.Tensor) -> bool:
        """Whether every valid token of `ids[:, start:end]` (whole chunks; `valid: [B, end − start]`) is at its
        chunk's anchor (`chunk_tables`) plus its place in the chunk. Reads one flag back from the device, once for
        the layers that hold the same ids."""
        if self._checked is not None and self._checked[0] is ids and self._checked[1] == (start, end, chunk):
            return self._checked[2]
        held = ids[:, start:end].unflatten(1, (-1, chunk))  # [B, NC, C]
        placed = run_from(chunk_anchors(ids[:, start:end], chunk), chunk)
        runs = bool(((held == placed) | ~valid.unflatten(1, (-1, chunk))).all())
        self._checked = (ids, (start, end, chunk), runs)
        return runs

    def _kept(self, ids: torch.Tensor, span: tuple, compute: Callable[[], tuple]) -> tuple:
        for held, kept_span, tables in self._tables:
            if held is ids and kept_span == span:
                return tables
        tables = compute()
        self._tables = [*self._tables, (ids, span, tables)][-self.KEPT :]
        return tables

    @property
    def tables_held(self) -> int:
        return len(self._tables)

    def release(self) -> None:
        """Forget the tables (and the last ids, whose memory a store may since have dropped)."""
        self._extended, self._dropped, self._tables, self._checked = None, None, [], None


class TrackedPositions:
    """Position ids `[B, length]` of the tokens held, in sequence order, and the rotary embedding of any of them
    (what transforms that require "cos"/"sin" read).

    Args:
        rope: the model's rotary embedding: a `SharedRope` the cache's other layers share, or a function (shared by
            no other store).
    """

    def __init__(self, rope: RopeFn | SharedRope):
        self.shared = rope if isinstance(rope, SharedRope) else SharedRope(rope)
        self.ids: torch.Tensor | None = None
        #: every encoded chunk checked so far runs on from its anchor (`SharedRope.runs_by_chunk`)
        self.by_chunk = True

    def extend(self, positions: torch.Tensor | None, batch: int, tokens: int, device: torch.device,
               dropped: int = 0) -> None:
        """Keep `tokens` new tokens' position ids `[B or 1, T]` (default: their index in the sequence, where `dropped`
        tokens came before the held ones)."""
        self.ids = self.shared.extended(self.ids, positions, batch, tokens, device, dropped)

    def rope_inputs(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """`{"cos", "sin"}` of the tokens held at indices [start, end)."""
        cos, sin = self.shared.tables(self.ids, start, end)
        return {"cos": cos, "sin": sin}

    def check_chunks(self, start: int, end: int, chunk: int, valid: torch.Tensor) -> None:
        """Note whether the tokens at [start, end), about to be encoded in chunks, run on from their anchors."""
        self.by_chunk = self.by_chunk and self.shared.runs_by_chunk(self.ids, start, end, chunk, valid)

    def chunk_inputs(self, start: int, end: int, chunk: int) -> dict[str, torch.Tensor]:
        """`SharedRope.chunk_tables` of the tokens held at [start, end) (requires `by_chunk`)."""
        return self.shared.chunk_tables(self.ids, start, end, chunk)

    def rope_at(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """`{"cos", "sin"}` of the tokens held at `index: [B, N]`."""
        cos, sin = self.shared.rope(self.ids.gather(1, index))
        return {"cos": cos, "sin": sin}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.ids is None else {"positions": self.ids}

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.ids is not None:
            self.ids = fn(self.ids)

    def drop_front(self, tokens: int) -> None:
        """Forget the first `tokens` ids."""
        self.ids = self.shared.dropped(self.ids, tokens)

    def keep(self, tokens: int) -> None:
        """Keep the first `tokens` ids."""
        if self.ids is not None:
            self.ids = owned(self.ids[:, :tokens])
