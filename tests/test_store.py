"""KVStore: window rules, exactness of full-precision tokens, accounting, batch and length edits."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchkv.ops.attention import attend_dense
from torchkv.pipeline import KVPipeline
from torchkv.store import KVStore
from torchkv.testing import llama_rope


def _stream(store, k, v, sizes, valid=None):
    start = 0
    for n in sizes:
        sl = slice(start, start + n)
        store.append(k[:, :, sl], v[:, :, sl], None if valid is None else valid[:, sl])
        start += n
    return start


@given(
    sizes=st.lists(st.integers(1, 90), min_size=1, max_size=8),
    residual=st.sampled_from([0, 16, 40]),
    sinks=st.sampled_from([0, 1, 4]),
    seed=st.integers(0, 1000),
)
def test_window_rules_and_exactness(sizes, residual, sinks, seed):
    pipe = KVPipeline.from_preset("kivi-2bit", residual=residual, sinks=sinks, group=16, compile=False)
    g = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    k, v = torch.randn(2, 3, total, 32, generator=g), torch.randn(2, 3, total, 32, generator=g)
    store = KVStore(pipe)
    _stream(store, k, v, sizes)
    assert store.length == total == store.n_sinks + store.n_encoded + store.n_residual
    assert store.n_sinks == min(sinks, total)
    assert store.n_encoded % pipe.chunk == 0
    assert store.n_residual < residual + pipe.chunk
    if total - store.n_sinks >= residual + pipe.chunk:
        assert store.n_residual >= residual
    hk, hv = store.history()
    assert hk.shape == k.shape
    fp = torch.ones(total, dtype=torch.bool)
    fp[store.n_sinks : store.n_sinks + store.n_encoded] = False
    assert torch.equal(hk[:, :, fp], k[:, :, fp]) and torch.equal(hv[:, :, fp], v[:, :, fp])
    # encoded tokens: within the 2-bit quantizers' step (their range spans ~6 sigma)
    assert (hk - k).abs().max() <= 4.0


@given(sizes=st.lists(st.integers(1, 70), min_size=1, max_size=6))
def test_nbytes_is_the_storage_of_every_tensor_and_no_fp_copy(sizes):
    pipe = KVPipeline.from_preset("kivi-2bit", residual=32, sinks=2, compile=False)
    total = sum(sizes)
    k = torch.randn(1, 3, total, 64)
    store = KVStore(pipe)
    _stream(store, k, k, sizes)
    held = store.tensors()
    assert store.nbytes() == sum(t.untyped_storage().nbytes() for t in held.values())
    full_precision = sum(t.numel() for t in held.values() if t.is_floating_point() and t.element_size() >= 4)
    window = (pipe.sinks + pipe.residual + pipe.chunk) * 3 * 64 * 2  # sinks + window buffers, K and V
    assert full_precision <= window
    if store.n_encoded:
        assert store.encoded_bits_per_value() == pytest.approx(3.0)


def test_prefill_then_decode_equals_token_by_token_encoding():
    pipe = KVPipeline.from_preset("kivi-4bit", residual=16, compile=False)
    k, v = torch.randn(1, 3, 200, 64), torch.randn(1, 3, 200, 64)
    a, b = KVStore(pipe), KVStore(pipe)
    _stream(a, k, v, [200])
    _stream(b, k, v, [1] * 200)
    assert a.n_encoded == b.n_encoded and a.encoded.keys() == b.encoded.keys()
    assert all(torch.equal(a.encoded[n], b.encoded[n]) for n in a.encoded)


def _stream_with_queries(store, k, q, sizes):
    start = 0
    for n in sizes:
        sl = slice(start, start + n)
        store.append(k[:, :, sl], k[:, :, sl], inputs={"queries": q[:, :, sl]})
        start += n


@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    residual=st.sampled_from([0, 8, 24]),
    sinks=st.sampled_from([0, 2]),
    seed=st.integers(0, 1000),
)
def test_a_store_prepares_from_every_token_once_it_holds_a_chunk(sizes, residual, sinks, seed):
    """Per-sequence state (frontier's balance scales) is prepared from the first tokens once a chunk of them is held,
    before any is encoded; the tokens before are kept for it (counted in `tensors`) and their state is exactly a prompt
    of all of them alone."""
    pipe = KVPipeline.from_preset("frontier-2bit", residual=residual, sinks=sinks, chunk=8, compile=False)
    g = torch.Generator().manual_seed(seed)
    k, q = torch.randn(1, 3, 200, 64, generator=g), torch.randn(1, 6, 200, 64, generator=g)
    store = KVStore(pipe)
    _stream_with_queries(store, k, q, sizes)
    held = sum(sizes)
    ends = torch.tensor(sizes).cumsum(0)
    if held < pipe.chunk:
        assert store.awaits_prepare and not store.prepared and store.n_encoded == 0
        assert store.tensors()["unprepared.queries"].shape[2] == held
        return
    first = int(ends[ends >= pipe.chunk][0])  # the tokens held when a chunk of them was
    alone = KVStore(pipe)
    _stream_with_queries(alone, k, q, [first])
    assert not store.awaits_prepare and not store.unprepared and store.prepared.keys() == alone.prepared.keys()
    assert all(torch.equal(store.prepared[n], alone.prepared[n]) for n in alone.prepared)


def test_a_store_awaiting_its_state_crops_and_reorders_the_tokens_it_keeps():
    pipe = KVPipeline.from_preset("frontier-2bit", residual=8, sinks=2, chunk=8, compile=False)
    k, q = torch.randn(2, 3, 20, 64), torch.randn(2, 6, 20, 64)
    store = KVStore(pipe)
    _stream_with_queries(store, k, q, [3, 2])
    store.reorder(torch.tensor([1, 1]))
    store.crop(2)
    _stream_with_queries(store, k[[1, 1], :, 3:], q[[1, 1], :, 3:], [5])
    alone = KVStore(pipe)
    kept = torch.cat([k[[1, 1], :, :3], k[[1, 1], :, 3:8]], 2), torch.cat([q[[1, 1], :, :3], q[[1, 1], :, 3:8]], 2)
    _stream_with_queries(alone, *kept, [8])
    assert store.length == 8 and all(torch.equal(store.prepared[n], alone.prepared[n]) for n in alone.prepared)


def test_padding_does_not_enter_statistics():
    pipe = KVPipeline.from_preset("kivi-2bit", residual=0, compile=False)
    k = torch.randn(2, 3, 64, 64)
    valid = torch.ones(2, 64, dtype=torch.bool)
    valid[1, :10] = False
    polluted = k.clone()
    polluted[1, :, :10] = 1e3
    store, clean = KVStore(pipe), KVStore(pipe)
    store.append(polluted, polluted, valid)
    clean.append(k, k, valid)
    hk, _ = store.history()
    ck, _ = clean.history()
    torch.testing.assert_close(hk[1, :, 10:], ck[1, :, 10:])
    assert torch.isfinite(hk).all()


def test_reorder_and_crop():
    pipe = KVPipeline.from_preset("kivi-4bit", residual=16, sinks=2, compile=False)
    k, v = torch.randn(3, 3, 100, 64), torch.randn(3, 3, 100, 64)
    store = KVStore(pipe)
    _stream(store, k, v, [70, 30])
    hk, hv = store.history()
    store.reorder(torch.tensor([2, 0, 0]))
    rk, _ = store.history()
    assert torch.equal(rk, hk[[2, 0, 0]])
    store.crop(5)  # inside the window: exact
    ck, _ = store.history()
    assert store.length == 95 and torch.equal(ck, rk[:, :, :95])
    store.crop(40)  # into the encoded chunks: kept tokens unchanged
    ck2, _ = store.history()
    assert store.length == 55 and torch.equal(ck2, rk[:, :, :55])
    store.append(k[:, :, :10], v[:, :, :10])
    assert store.length == 65
    store.reset()
    assert store.length == 0 and store.nbytes() == 0


def test_pre_rope_store_requires_a_rope_function():
    import torchkv.transforms as T

    pipe = KVPipeline([T.rotate("pre_rope"), T.quantize("cast")], [T.quantize("cast")], residual=0)
    with pytest.raises(ValueError, match="needs the model's rope function"):
        KVStore(pipe)


def _llama_rope(positions: torch.Tensor):
    """Llama-style rotary tables `[B, T, 16]` of `positions: [B, T]` (head dim 16), scaled as YaRN scales them."""
    return tuple(1.1 * t for t in llama_rope(positions, 16))


@pytest.mark.parametrize("pads", [(0, 0), (0, 5), (3, 12)])
def test_turned_centre_attention_by_chunk_equals_every_tokens_tables(pads, monkeypatch):
    """Decode steps over a left-padded prompt (pads at position 1, as transformers numbers them) and across window
    flushes: attention with a turned centre's offsets from the chunks' tables gives the output the tokens' own
    tables give; positions with a gap fall back to the tokens' tables."""
    from torchkv.positions import TrackedPositions

    g = torch.Generator().manual_seed(0)
    batch, prompt, steps = len(pads), 29, 11
    pipe = KVPipeline.from_preset("frontier-2bit", rotary_center=True, residual=4, chunk=4, compile=False)
    valid = torch.tensor([[t >= p for t in range(prompt)] for p in pads])
    positions = (valid.cumsum(1) - 1).masked_fill(~valid, 1)
    k = torch.randn(batch, 2, prompt + steps, 16, generator=g) + 3 * torch.randn(16, generator=g)
    v = torch.randn(batch, 2, prompt + steps, 16, generator=g)
    queries = torch.randn(steps, batch, 4, 1, 16, generator=g)
    prompt_queries = {"queries": torch.randn(batch, 4, prompt, 16, generator=g)}
    outs = {}
    for by_chunk in (True, False):
        if not by_chunk:
            monkeypatch.setattr(TrackedPositions, "check_chunks", lambda self, *a: setattr(self, "by_chunk", False))
        store = KVStore(pipe, rope=_llama_rope)
        store.append(k[:, :, :prompt], v[:, :, :prompt], valid=valid, positions=positions, inputs=prompt_queries)
        mask = torch.cat([valid, torch.ones(batch, steps, dtype=torch.bool)], 1)[:, None, None]
        step_outs = []
        for i in range(steps):
            at = prompt + i
            reads = store.attention_inputs()
            assert store.n_encoded and ("anchor_cos" in reads) == by_chunk
            step_outs.append(store.decode_step(
                queries[i], k[:, :, at : at + 1], v[:, :, at : at + 1], mask[..., : at + 1], 0.25,
                positions=positions[:, -1:] + i + 1))
        outs[by_chunk] = torch.stack(step_outs)
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
    gap = KVStore(pipe, rope=_llama_rope)
    gap.append(k[:, :, :prompt], v[:, :, :prompt], positions=torch.arange(prompt)[None] * 2, inputs=prompt_queries)
    assert not gap.positions.by_chunk and "cos" in gap.attention_inputs()


def _decode(store, query, k, v, mask, valid):
    """One decode step as the attention function takes it: over the encoded chunks when there are any, else over the
    full-precision history."""
    if store.n_encoded:
        return store.decode_step(query, k, v, mask, 0.125, valid=valid)
    keys, values = store.history()
    out = attend_dense(query, torch.cat([keys, k], 2), torch.cat([values, v], 2), mask, 0.125, None)[0]
    store.append(k, v, valid=valid)
    return out


def _sliding_rule(window: int):
    """transformers' sliding-window rule over absolute indices: a query reads the keys after `q − window`."""
    return lambda q, kv: (kv <= q) & (kv > q - window)


@settings(max_examples=12, deadline=None)
@given(
    prompt=st.integers(1, 100),
    steps=st.integers(1, 50),
    window=st.sampled_from([25, 40, 64]),
    sinks=st.sampled_from([0, 3]),
    preset=st.sampled_from(["kivi-2bit", "frontier-2bit"]),
    pad=st.integers(0, 6),
    seed=st.integers(0, 1000),
)
def test_a_sliding_window_store_drops_what_no_later_query_reads(prompt, steps, window, sinks, preset, pad, seed):
    """A store given the layer's sliding window drops its sinks and then whole encoded chunks once every token of them
    is out of reach of the next query, and decodes as a store that keeps every token under the same mask: outputs
    within 1e-5, position ids of the tokens it holds equal, and it holds at most `window − 1` tokens besides one
    chunk's or the sinks' worth that are already out of reach."""
    g = torch.Generator().manual_seed(seed)
    options = {"rotary_center": True, "chunk": 8} if preset == "frontier-2bit" else {"group": 8}
    pipe = KVPipeline.from_preset(preset, residual=8, sinks=sinks, compile=False, **options)
    total = prompt + steps
    k = torch.randn(2, 2, total, 64, generator=g) + 2 * torch.randn(64, generator=g)
    v = torch.randn(2, 2, total, 64, generator=g)
    valid = torch.ones(2, total, dtype=torch.bool)
    valid[1, : min(pad, prompt - 1)] = False
    rope = lambda p: llama_rope(p, 64)  # noqa: E731
    kept, dropping = KVStore(pipe, rope=rope), KVStore(pipe, rope=rope, sliding_window=window)
    queries = {"queries": torch.randn(2, 4, prompt, 64, generator=g)}
    for store in (kept, dropping):
        store.append(k[:, :, :prompt], v[:, :, :prompt], valid=valid[:, :prompt], inputs=queries)
    rule = _sliding_rule(window)
    for at in range(prompt, total):
        q = torch.randn(2, 4, 1, 64, generator=g)
        mask = (rule(torch.tensor(at), torch.arange(at + 1)) & valid[:, : at + 1])[:, None, None]
        new = (q, k[:, :, at : at + 1], v[:, :, at : at + 1])
        expected = _decode(kept, *new, mask, valid[:, at : at + 1])
        got = _decode(dropping, *new, mask[..., dropping.dropped :], valid[:, at : at + 1])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert dropping.n_seen == kept.length == at + 1
        assert dropping.length <= window - 1 + max(pipe.chunk - 1, sinks)
        if at + 1 - window >= sinks + pipe.chunk + pipe.residual + pipe.chunk:  # a chunk encoded and passed
            assert dropping.dropped > 0 and dropping.n_sinks == 0
    if preset == "frontier-2bit":
        assert torch.equal(dropping.positions.ids, kept.positions.ids[:, dropping.dropped :])
    assert dropping.nbytes() < kept.nbytes() or not dropping.dropped


def test_a_sliding_window_store_refuses_a_crop_into_what_it_dropped():
    """Removing the last tokens would let later queries reach tokens already dropped: refused with how many may go
    (as transformers' sliding layers refuse), while a crop that stays within reach is exact."""
    pipe = KVPipeline.from_preset("kivi-2bit", residual=8, group=8, compile=False)
    store = KVStore(pipe, sliding_window=32)
    k = torch.randn(1, 2, 100, 64)
    _stream(store, k, k, [60, 40])
    assert store.dropped == 64 and store.n_seen == 100
    with pytest.raises(ValueError, match="sliding window of 32 tokens.*remove at most 5"):
        store.crop(6)
    store.crop(5)
    assert store.n_seen == 95 and store.dropped == 64
