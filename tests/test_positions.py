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


@given(
    chunk=st.sampled_from([1, 4, 8]),
    chunks=st.integers(1, 4),
    sinks=st.integers(0, 3),
    pads=st.lists(st.integers(0, 12), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_chunk_tables_turn_the_valid_tokens_as_their_own_tables(chunk, chunks, sinks, pads, seed):
    """Left-padded rows (pads at position 1, then 0, 1, 2, ... as transformers numbers them) run by chunk, and the
    chunk tables give each valid token the score its own cos/sin give."""
    from torchkv.ops import turned_dot, turned_dot_by_chunk

    batch, length = len(pads), sinks + chunks * chunk
    pads = [min(p, length) for p in pads]
    ids = torch.stack([torch.cat([torch.ones(p, dtype=torch.long), torch.arange(length - p)]) for p in pads])
    valid = ids.new_tensor([[t >= p for t in range(length)] for p in pads], dtype=torch.bool)
    calls = []
    shared = SharedRope(_counted_rope(calls))
    layers = [TrackedPositions(shared) for _ in range(2)]
    for tracked in layers:
        tracked.extend(ids, batch, length, torch.device("cpu"))
        tracked.check_chunks(sinks, length, chunk, valid[:, sinks:])
    assert all(tracked.by_chunk for tracked in layers)
    g = torch.Generator().manual_seed(seed)
    q, x = torch.randn(batch, 2, 3, 4, generator=g), torch.randn(batch, 2, 1, 4, generator=g)
    tables = layers[0].chunk_inputs(sinks, length, chunk)
    assert tables["anchor_cos"].shape == (batch, chunks, 4) and tables["step_cos"].shape == (1, chunk, 4)
    got = turned_dot_by_chunk(q, x, *(tables[n] for n in ("anchor_cos", "anchor_sin", "step_cos", "step_sin")))
    own = layers[0].rope_inputs(sinks, length)
    expected = turned_dot(q, x, own["cos"], own["sin"])
    keep = valid[:, None, None, sinks:].expand_as(expected)
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-5)


def test_positions_that_skip_or_end_in_padding_do_not_run_by_chunk():
    """A gap in the positions, or a chunk whose last token is padding (right padding), is found: the tokens'
    own tables are then read."""
    shared = SharedRope(_counted_rope([]))
    for ids, valid in (
        (torch.tensor([[0, 1, 2, 3, 4, 6, 7, 8]]), torch.ones(1, 8, dtype=torch.bool)),
        (torch.tensor([[0, 1, 2, 1, 3, 4, 5, 6]]), torch.tensor([[True, True, True, False] + [True] * 4])),
    ):
        tracked = TrackedPositions(shared)
        tracked.extend(ids, 1, 8, torch.device("cpu"))
        tracked.check_chunks(0, 8, 4, valid)
        assert not tracked.by_chunk
