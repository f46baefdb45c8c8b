"""TrackedPositions and SharedRope: the layers of a cache share their position ids and a step's cos/sin, and sharing
never changes a value."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from torchkv.positions import SharedRope, TrackedPositions


def _counted_rope(calls: list):
    """A rotary embedding `[B, T] -> [B, T, 4]` that records each call."""

    def rope(positions: torch.Tensor):
        calls.append(positions.shape)
        angles = positions[..., None].float() * torch.tensor([1.0, 0.1, 1.0, 0.1])
        return angles.cos(), angles.sin()

    return rope


@given(
    steps=st.lists(st.tuples(st.integers(1, 6), st.booleans()), min_size=1, max_size=6),
    layers=st.integers(1, 4),
    batch=st.integers(1, 3),
    diverged=st.booleans(),
)
def test_shared_positions_equal_each_layers_own(steps, layers, batch, diverged):
    """Layers extended by the same positions tensor (or by default positions) hold one ids tensor equal to what
    each would hold alone, and the rope runs once a step for them all; a layer whose ids diverged (a reordered batch)
    still gets its own values."""
    shared_calls, own_calls = [], []
    shared = SharedRope(_counted_rope(shared_calls))
    together = [TrackedPositions(shared) for _ in range(layers)]
    alone = [TrackedPositions(_counted_rope(own_calls)) for _ in range(layers)]
    held = 0
    for step, (tokens, given_positions) in enumerate(steps):
        positions = torch.arange(held, held + tokens)[None] + 3 if given_positions else None
        before = len(shared_calls)
        for i, (mine, own) in enumerate(zip(together, alone)):
            mine.extend(positions, batch, tokens, torch.device("cpu"))
            own.extend(positions, batch, tokens, torch.device("cpu"))
            if diverged and i == layers - 1 and step == 0:
                flip = torch.arange(batch - 1, -1, -1)
                mine.map_batch(lambda t: t.index_select(0, flip))
                own.map_batch(lambda t: t.index_select(0, flip))
            assert torch.equal(mine.ids, own.ids)
            for start, end in ((0, held + tokens), (held, held + tokens)):
                got, expected = mine.rope_inputs(start, end), own.rope_inputs(start, end)
                assert torch.equal(got["cos"], expected["cos"]) and torch.equal(got["sin"], expected["sin"])
        held += tokens
        if not diverged:
            assert all(t.ids is together[0].ids for t in together)
            assert len(shared_calls) - before == len({0, held - tokens})  # each range once for every layer
    assert len(shared_calls) <= len(own_calls)


def test_release_forgets_the_tables():
    calls = []
    shared = SharedRope(_counted_rope(calls))
    tracked = TrackedPositions(shared)
    tracked.extend(None, 1, 5, torch.device("cpu"))
    tracked.rope_inputs(0, 5)
    tracked.rope_inputs(0, 5)
    assert len(calls) == 1 and shared.tables_held == 1
    shared.release()
    assert shared.tables_held == 0
    tracked.rope_inputs(0, 5)
    assert len(calls) == 2


def test_a_plain_function_is_shared_by_no_other_store():
    rope = _counted_rope([])
    a, b = TrackedPositions(rope), TrackedPositions(rope)
    assert a.shared is not b.shared
