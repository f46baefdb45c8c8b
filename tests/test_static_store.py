"""StaticKVStore with a key centre turned to each position (`predict.rotary_center`): the fixed-shape buffers keep
the positions (sinks and window per token, encoded chunks by anchor) and decode as the growing store does."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchkv.ops.attention import attend_dense
from torchkv.pipeline import KVPipeline
from torchkv.static_store import StaticKVStore, static_refusal
from torchkv.store import KVStore
from torchkv.testing import llama_rope

HEAD_DIM = 16


def _rope(positions: torch.Tensor):
    """Llama-style rotary tables `[B, T, 16]`, scaled as YaRN scales them (the anchors' tables carry the scale)."""
    return tuple(1.1 * t for t in llama_rope(positions, HEAD_DIM))


def _pipeline(chunk: int, residual: int, sinks: int) -> KVPipeline:
    return KVPipeline.from_preset("frontier-2bit", rotary_center=True, residual=residual, chunk=chunk, sinks=sinks,
                                  compile=False)


def test_a_turned_centre_decodes_on_fixed_shape_buffers():
    assert static_refusal(_pipeline(4, 4, 0)) is None
    assert "pre-RoPE" in static_refusal(KVPipeline.from_preset("squat-pre-2bit", compile=False))
    with pytest.raises(ValueError, match="rope function"):
        StaticKVStore(_pipeline(4, 4, 0), 64)


@settings(max_examples=12, deadline=None)
@given(
    pads=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    prompt=st.integers(10, 30),
    steps=st.integers(1, 24),
    chunk=st.sampled_from([4, 8]),
    residual=st.sampled_from([0, 4, 8]),
    sinks=st.sampled_from([0, 2]),
    offset=st.one_of(st.none(), st.integers(0, 500)),
    seed=st.integers(0, 1000),
)
def test_fixed_buffers_decode_a_turned_centre_as_the_growing_store(pads, prompt, steps, chunk, residual, sinks,
                                                                   offset, seed):
    """Decode steps over a left-padded prompt (pads at position 1, as transformers numbers them), positions that start
    anywhere or none given (each token's index), sinks and window flushes: the fixed-shape buffers give the growing
    store's outputs, and thawed they hold its positions (every valid token's, and its chunks still run on)."""
    g = torch.Generator().manual_seed(seed)
    batch, total = len(pads), prompt + steps
    pipe = _pipeline(chunk, residual, sinks)
    valid = torch.tensor([[t >= min(p, prompt - 1) for t in range(prompt)] for p in pads])
    positions = (valid.cumsum(1) - 1 + (offset or 0)).masked_fill(~valid, 1) if offset is not None else None
    k = torch.randn(batch, 2, total, HEAD_DIM, generator=g) + 3 * torch.randn(HEAD_DIM, generator=g)
    v = torch.randn(batch, 2, total, HEAD_DIM, generator=g)
    queries = torch.randn(steps, batch, 4, 1, HEAD_DIM, generator=g)
    prompt_queries = {"queries": torch.randn(batch, 4, prompt, HEAD_DIM, generator=g)}
    padding = torch.cat([valid, torch.ones(batch, total + 8 - prompt, dtype=torch.bool)], 1)
    stores = [KVStore(pipe, rope=_rope) for _ in range(2)]
    for store in stores:
        store.append(k[:, :, :prompt], v[:, :, :prompt], valid=valid, positions=positions, inputs=prompt_queries)
    if positions is None:
        assert torch.equal(stores[0].positions.ids, torch.arange(prompt).expand(batch, -1))
    growing, static = stores[0], StaticKVStore(pipe, total + 8, rope=_rope)
    static.freeze(stores[1])
    for i in range(steps):
        at, step_positions = prompt + i, None if positions is None else positions[:, -1:] + i + 1
        new = (queries[i], k[:, :, at : at + 1], v[:, :, at : at + 1])
        expected = growing.decode_step(*new, padding[:, None, None, : at + 1], 0.25, None, positions=step_positions)
        got = static.decode_step(*new, padding, None, 0.25, None, step_positions)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert int(static.buffers["n_chunks"]) * chunk == growing.n_encoded
    thawed = KVStore(pipe, rope=_rope)
    static.thaw(thawed)
    held = torch.cat([valid, torch.ones(batch, steps, dtype=torch.bool)], 1)
    assert torch.equal(thawed.positions.ids[held], growing.positions.ids[held])
    assert thawed.positions.by_chunk and thawed.n_encoded == growing.n_encoded


def test_a_prompt_whose_positions_skip_is_refused_with_what_to_do():
    """One anchor per chunk cannot hold positions that skip inside a chunk: freezing such a prompt is a clear error
    (the growing store reads every token's tables instead)."""
    pipe = _pipeline(4, 4, 0)
    k = torch.randn(1, 2, 20, HEAD_DIM)
    store = KVStore(pipe, rope=_rope)
    store.append(k, k, positions=torch.arange(20)[None] * 2, inputs={"queries": torch.randn(1, 4, 20, HEAD_DIM)})
    with pytest.raises(ValueError, match="do not run on by one.*consecutive position_ids"):
        StaticKVStore(pipe, 64, rope=_rope).freeze(store)


def _sliding_rule(window: int):
    """transformers' sliding-window rule over absolute indices: a query reads the keys after `q − window`."""
    return lambda b, h, q, kv: (kv <= q) & (kv > q - window)


@settings(max_examples=12, deadline=None)
@given(
    prompt=st.integers(1, 80),
    steps=st.integers(1, 60),
    window=st.sampled_from([25, 40]),
    sinks=st.sampled_from([0, 3]),
    preset=st.sampled_from(["kivi-2bit", "frontier-2bit"]),
    pad=st.integers(0, 6),
    rule_given=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_fixed_buffers_of_a_sliding_layer_hold_only_the_chunks_its_window_reaches(prompt, steps, window, sinks, preset,
                                                                                   pad, rule_given, seed):
    """A sliding-window layer's buffers have ⌈(W − 1) / chunk⌉ + 1 chunk slots and drop the oldest chunk when they
    are full: decode steps from a prompt store that dropped what its window passed give the outputs of a store that
    keeps every token, under the window's mask (whether or not the model's rule is passed), and thawed they hold what
    the growing store holds, from which decoding goes on."""
    g = torch.Generator().manual_seed(seed)
    options = {"rotary_center": True, "chunk": 8} if preset == "frontier-2bit" else {"group": 8}
    pipe = KVPipeline.from_preset(preset, residual=8, sinks=sinks, compile=False, **options)
    total = prompt + steps
    k = torch.randn(2, 2, total + 1, HEAD_DIM, generator=g) + 2 * torch.randn(HEAD_DIM, generator=g)
    v = torch.randn(2, 2, total + 1, HEAD_DIM, generator=g)
    valid = torch.ones(2, total + 9, dtype=torch.bool)
    valid[1, : min(pad, prompt - 1)] = False
    kept, dropping = KVStore(pipe, rope=_rope), KVStore(pipe, rope=_rope, sliding_window=window)
    queries = {"queries": torch.randn(2, 4, prompt, HEAD_DIM, generator=g)}
    for store in (kept, dropping):
        store.append(k[:, :, :prompt], v[:, :, :prompt], valid=valid[:, :prompt], inputs=queries)
    static = StaticKVStore(pipe, total + 8, rope=_rope, sliding_window=window)
    assert static.chunks == min(-(-(window - 1) // 8) + 1, -(-(total + 8) // 8))
    static.freeze(dropping)
    rule = _sliding_rule(window)

    def growing_step(store, q, at):
        mask = (rule(0, 0, torch.tensor(at), torch.arange(store.dropped, at + 1)) & valid[:, store.dropped : at + 1])
        new = (q, k[:, :, at : at + 1], v[:, :, at : at + 1])
        if store.n_encoded:
            return store.decode_step(*new, mask[:, None, None], 0.125, valid=valid[:, at : at + 1])
        keys, values = store.history()
        out = attend_dense(q, torch.cat([keys, new[1]], 2), torch.cat([values, new[2]], 2), mask[:, None, None],
                           0.125, None)[0]
        store.append(*new[1:], valid=valid[:, at : at + 1])
        return out

    for at in range(prompt, total):
        q = torch.randn(2, 4, 1, HEAD_DIM, generator=g)
        expected = growing_step(kept, q, at)
        got = static.decode_step(q, k[:, :, at : at + 1], v[:, :, at : at + 1], valid, rule if rule_given else None,
                                 0.125, None)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    held = int(static.buffers["n_chunks"])
    assert held <= static.chunks and int(static.buffers["length"]) == total
    if total - window >= sinks + (static.chunks + 2) * 8:  # more chunks passed than the slots hold
        assert int(static.buffers["dropped"]) > 0
    thawed = KVStore(pipe, rope=_rope, sliding_window=window)
    static.thaw(thawed)
    assert thawed.n_seen == total and thawed.n_encoded == held * 8
    if preset == "frontier-2bit":
        assert torch.equal(thawed.positions.ids, kept.positions.ids[:, thawed.dropped :])
    q = torch.randn(2, 4, 1, HEAD_DIM, generator=g)
    torch.testing.assert_close(growing_step(thawed, q, total), growing_step(kept, q, total), rtol=1e-5, atol=1e-5)
