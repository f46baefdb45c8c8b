"""SubKV: the dynamic window policy (spec §5.2 S6–S12) on synthetic streams, and on SmolLM2."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchkv.models import cache_argument
from torchkv.pipeline import KVPipeline
from torchkv.store import KVStore
from torchkv.window import DynamicWindow


def _feed(store, k, v, sizes, attention_of):
    """Append `k`, `v` [B, H, T, D] in blocks of `sizes`; after the first block each gets the
    attention rows `attention_of(t, fp_tokens)` ([t, fp_tokens]). Returns the window size after each block."""
    start, windows = 0, []
    for t in sizes:
        fp = store.n_sinks + store.n_residual + t
        att = attention_of(t, fp) if store.length else None
        store.append(k[:, :, start : start + t], v[:, :, start : start + t], attention=att)
        start += t
        windows.append((store.n_residual, store.window_limit))
    return windows


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    sink=st.booleans(),
    max_window=st.sampled_from([32, 48, 100]),
    seed=st.integers(0, 10_000),
)
def test_every_token_is_sink_window_or_quantized_once_and_the_window_is_bounded(sizes, sink, max_window, seed):
    pipe = KVPipeline.from_preset("subkv-2bit", sink=sink, max_window=max_window, compile=False)
    g = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    k, v = torch.randn(2, 3, total, 32, generator=g), torch.randn(2, 3, total, 32, generator=g)
    store = KVStore(pipe)
    windows = _feed(store, k, v, sizes, lambda t, fp: torch.rand(t, fp, generator=g))
    limits = [limit for _, limit in windows]
    assert limits == sorted(limits) and limits[0] >= 32 and limits[-1] <= max_window  # S9, bounded
    assert all(n < limit for n, limit in windows)
    assert store.length == total == store.n_sinks + store.n_encoded + store.n_residual  # S6
    assert store.n_sinks == min(int(sink), total) and store.n_encoded % 32 == 0  # S7
    # keys and values cover the same tokens, and the encoded ones are exactly one encoding of them, in order
    s, e = store.n_sinks, store.n_sinks + store.n_encoded
    hk, hv = store.history()
    assert hk.shape == hv.shape == k.shape
    fp = torch.ones(total, dtype=torch.bool)
    fp[s:e] = False
    assert torch.equal(hk[:, :, fp], k[:, :, fp]) and torch.equal(hv[:, :, fp], v[:, :, fp])  # S2, S3
    if store.n_encoded:
        once_k, once_v = pipe.decode_chunk(pipe.encode_chunk(k[:, :, s:e], v[:, :, s:e]), head_dim=32)
        assert torch.equal(hk[:, :, s:e], once_k) and torch.equal(hv[:, :, s:e], once_v)


@given(p_edge=st.floats(0, 1), p_new=st.floats(0, 1), extra=st.integers(0, 8))
def test_a_full_window_grows_exactly_when_its_oldest_token_gets_at_least_the_newest_tokens_attention(
    p_edge, p_new, extra
):
    """S10, ties grow (A8): one decode step that fills the window."""
    pipe = KVPipeline.from_preset("subkv-2bit", compile=False)
    store = KVStore(pipe)
    store.window_limit += extra
    x = torch.randn(1, 1, 1 + 32 + extra, 32)
    store.append(x[:, :, :1], x[:, :, :1])  # the sink
    store.append(x[:, :, 1:-1], x[:, :, 1:-1])  # a window one token short of full
    att = torch.zeros(1, 1 + store.n_residual + 1)
    att[0, 1], att[0, -1] = p_edge, p_new
    store.append(x[:, :, -1:], x[:, :, -1:], attention=att)
    grew = store.window_limit == 32 + extra + 1
    assert grew == (p_edge >= p_new)
    assert store.n_encoded == (0 if grew else 32) and store.n_residual == (32 + extra if grew else extra)


def test_window_stops_growing_at_its_bound_and_then_flushes():
    pipe = KVPipeline.from_preset("subkv-4bit", max_window=40, compile=False)
    store = KVStore(pipe)
    x = torch.randn(1, 2, 200, 32)
    windows = _feed(store, x, x, [1] * 200, lambda t, fp: torch.ones(t, fp))  # the edge always ties: grow
    assert max(limit for _, limit in windows) == 40 and max(n for n, _ in windows) == 39
    assert store.n_encoded > 0 and store.length == 200


def test_without_sink_and_dynamic_window_it_is_kivi_with_a_window_of_n():
    """S12: the same stored tensors as KIVI with residual 0 and 32-token chunks."""
    x = torch.randn(1, 3, 300, 64)
    stores = []
    for pipe in (KVPipeline.from_preset("subkv-2bit", sink=False, dynamic=False, compile=False),
                 KVPipeline.from_preset("kivi-2bit", residual=0, compile=False)):
        store = KVStore(pipe)
        _feed(store, x, x, [100] + [1] * 200, lambda t, fp: None)
        stores.append(store)
    a, b = stores
    assert a.n_residual == b.n_residual and a.tensors().keys() == b.tensors().keys()
    assert all(torch.equal(t, b.tensors()[n]) for n, t in a.tensors().items())


def test_options_are_checked_and_saved(tmp_path):
    with pytest.raises(ValueError, match="multiple of group"):
        KVPipeline.from_preset("subkv-2bit", window=48)
    with pytest.raises(ValueError, match="max_window"):
        KVPipeline.from_preset("subkv-2bit", max_window=16)
    pipe = KVPipeline.from_preset("subkv-2bit", max_window=64)
    pipe.save_pretrained(tmp_path)
    assert KVPipeline.from_pretrained(tmp_path).window == DynamicWindow(64)


def test_packed_code_decode_attention_reports_the_probabilities_dense_attention_computes():
    """The window policy reads the decode step's own probabilities: compiled fused attention over packed
    codes returns, for sinks + window + new token, the mean probabilities of dense attention."""
    from torchkv.ops.attention import attend_dense

    pipe = KVPipeline.from_preset("subkv-2bit")
    k, v = torch.randn(2, 3, 128, 64), torch.randn(2, 3, 128, 64)
    state = pipe.encode_chunk(k, v)
    k_hat, v_hat = pipe.decode_chunk(state, head_dim=64)
    encoded = {n: t.unflatten(2, (4, t.shape[2] // 4)) for n, t in state.items()}
    k_fp, v_fp = torch.randn(2, 3, 9, 64), torch.randn(2, 3, 9, 64)
    q = torch.randn(2, 9, 1, 64)
    out, fp_attention, _ = pipe.attend_decode(q, encoded, k_fp, v_fp, None, 0.125)
    dense, probs = attend_dense(q, torch.cat([k_hat, k_fp], 2), torch.cat([v_hat, v_fp], 2), None, 0.125)
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fp_attention, probs.mean((0, 1, 2))[0, 128:], rtol=1e-4, atol=1e-6)


@pytest.mark.model
def test_generation_on_smollm2_grows_some_windows_within_the_bound(smollm2):
    """Growth is rare on SmolLM2 (12 of 192 decisions over 200 tokens after a 600-token prompt grew), so
    the generation is long enough to see some; the first tokens are full precision's (measured: the
    first 4 of 16 at 2 bits; quality is measured by `torchkv eval`)."""
    import torchkv
    from torchkv.corpora import documents

    model, tokenizer = smollm2
    ids = documents(tokenizer, 600, 1)
    with torchkv.patched(model, "subkv-2bit"):
        cache = torchkv.new_cache(model)
        tokens = model.generate(ids, **cache_argument(model, cache), max_new_tokens=160, do_sample=False)
        tokens = tokens[0, ids.shape[1] :]
    reference = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :]
    limits = [layer.store.window_limit for layer in cache.layers]
    assert any(limit > 32 for limit in limits) and max(limits) <= 128
    assert all(layer.store.n_residual < layer.store.window_limit for layer in cache.layers)
    assert torch.equal(tokens[:4], reference[:4])
