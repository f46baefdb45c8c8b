"""SVDq: the invariants of spec §3 (Q1–Q9, Q16, Q19, pads), the presets, and SmolLM2's real keys."""

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import torchkv.transforms as T
from torchkv.methods.svdq import SCHEDULES
from torchkv.models import cache_argument
from torchkv.pipeline import KVPipeline
from torchkv.store import KVStore
from torchkv.transforms import Context


def _keys(b, h, t, d, decay, seed, rotate=True):
    """[B, H, T, D] keys whose concatenation has singular values ~ e^{-decay·j} (mixed by a random rotation)."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(b, t, h * d, generator=g, dtype=torch.float64) * torch.exp(-decay * torch.arange(h * d))
    if rotate:
        q, _ = torch.linalg.qr(torch.randn(h * d, h * d, generator=g, dtype=torch.float64))
        latent = latent @ q
    offset = torch.randn(h * d, generator=g, dtype=torch.float64)
    return (latent + offset).float().unflatten(-1, (h, d)).transpose(1, 2)


def _latent(keys, keep=1.0):
    proj = T.project("svd", keep=keep, basis_dtype="float32")
    ctx = Context(dim=keys.shape[-1], prepared=proj.prepare(keys, Context(dim=keys.shape[-1])))
    p, _ = proj.encode(keys, ctx)
    return proj, ctx, p


def _columns(p):
    """[B, H, T, F] latent layout -> [B, T, r] latent channels in order."""
    return p.permute(0, 2, 3, 1).flatten(2)


@given(seed=st.integers(0, 10_000), t=st.integers(48, 160), decay=st.floats(0.0, 0.3))
def test_latent_columns_are_centred_energy_ordered_and_the_roundtrip_is_exact(seed, t, decay):
    """Q1 centring, Q2 energies = λ² non-increasing, Q3 Frobenius invariance, Q4 lossless path."""
    keys = _keys(1, 2, t, 16, decay, seed)
    proj, ctx, p = _latent(keys)
    cols = _columns(p).double()[0]  # [T, 32]
    scale = cols.abs().max()
    assert cols.mean(0).abs().max() <= 1e-5 * scale
    energy = (cols**2).sum(0)
    assert torch.all(energy[1:] <= energy[:-1] * (1 + 1e-4) + 1e-6 * energy[0])
    centred = keys.transpose(1, 2).flatten(2).double()[0]
    centred = centred - centred.mean(0)
    torch.testing.assert_close(energy.sum(), (centred**2).sum(), rtol=1e-4, atol=0)
    torch.testing.assert_close(proj.decode(p, {}, ctx), keys, rtol=0, atol=1e-4 * (1 + keys.abs().max()))


@given(seed=st.integers(0, 10_000), keep=st.sampled_from([0.25, 0.5, 0.75]))
def test_truncation_error_is_the_dropped_energy(seed, keep):
    """Q5 (Eckart–Young–Mirsky): keeping r latent channels exactly leaves Σ_{j>r} λ_j²."""
    keys = _keys(1, 2, 96, 16, 0.1, seed)
    _, _, p_all = _latent(keys)
    proj, ctx, p = _latent(keys, keep)
    error = ((proj.decode(p, {}, ctx) - keys).double() ** 2).sum()
    dropped = (_columns(p_all).double()[0, :, int(keep * 32) :] ** 2).sum()
    torch.testing.assert_close(error, dropped, rtol=1e-3, atol=1e-4)


@given(seed=st.integers(0, 10_000), bits=st.lists(st.integers(1, 8), min_size=1, max_size=4))
def test_schedule_codes_and_per_channel_error_bounds(seed, bits):
    """Q6: codes within each group's width, |P̂ - P| ≤ Δ/2 per channel, extremes kept; Q7 through
    orthogonality: the key error equals the latent error."""
    assume(16 % len(bits) == 0)
    keys = _keys(1, 2, 64, 16, 0.05, seed)
    proj, ctx, p = _latent(keys)
    quant = T.quantize("schedule", bits=tuple(bits), group=32)
    codes, state = quant.encode(p, Context(dim=16))
    p_hat = quant.decode(codes, state, Context(dim=16))
    width = torch.tensor(bits).repeat_interleave(16 // len(bits))
    assert torch.all(codes.long() < 2**width)
    step = state["scale"].float().repeat_interleave(32, dim=2)
    assert torch.all((p_hat - p).abs() <= step / 2 * (1 + 1e-5) + 1e-6)
    key_error = ((proj.decode(p_hat, {}, ctx) - keys).double() ** 2).sum()
    torch.testing.assert_close(key_error, ((p_hat - p).double() ** 2).sum(), rtol=1e-3, atol=1e-6)


@given(seed=st.integers(0, 10_000))
def test_beats_per_channel_quantization_when_the_spectrum_decays(seed):
    """Q19 (the spec's corrected claim, S5: a ratio near 2^{-b}, not "< 0.1"): with a strongly decaying
    spectrum mixed over the channels, SVDq at b̄ = 2 has an RMS key error at least 2x lower than
    per-channel quantization at 2 bits over the same 128-token ranges (measured 0.29–0.30 for seeds 0–7)."""
    keys = _keys(1, 4, 256, 16, 0.08, seed)
    svdq = KVPipeline.from_preset("svdq-2bit", group=128, compile=False)
    per_channel = KVPipeline([T.quantize(bits=2, axis="channel", group=128), T.pack()], [T.quantize("cast")],
                             compile=False)  # a new pipeline per example: compiled, each would compile afresh
    inputs = {"cos": torch.ones(1, 256, 16), "sin": torch.zeros(1, 256, 16)}  # position 0: RoPE is the identity
    prepared = svdq.prepare(keys, keys, inputs=inputs)
    k_svdq, _ = svdq.decode_chunk(svdq.encode_chunk(keys, keys, prepared=prepared, inputs=inputs), head_dim=16,
                                  prepared=prepared, inputs=inputs)
    k_direct, _ = per_channel.decode_chunk(per_channel.encode_chunk(keys, keys), head_dim=16)
    ratio = math.sqrt(((k_svdq - keys) ** 2).sum() / ((k_direct - keys) ** 2).sum())
    assert ratio < 0.5


def test_schedule_bits_accounting():
    """Q8/Q9: b̄ = mean(schedule); stored code bits s·(d/8)·Σ b_g; metadata 2 fp16 per kept channel per
    token group; the basis (fp16 d × d_keep) and mean (fp32 d) are per-sequence prepared state."""
    assert {k: sum(v) / 8 for k, v in SCHEDULES.items()} == {
        "3bit": 3.0, "2.25bit": 2.25, "2bit": 2.0, "1.75bit": 1.75, "1.25bit": 1.25
    }
    pipe = KVPipeline.from_preset("svdq-1.25bit", compile=False)
    keys = _keys(2, 3, 256, 64, 0.02, 0)
    inputs = {"cos": torch.ones(2, 256, 64), "sin": torch.zeros(2, 256, 64)}
    prepared = pipe.prepare(keys, keys, inputs=inputs)
    state = pipe.encode_chunk(keys, keys, prepared=prepared, inputs=inputs)
    d, kept = 3 * 64, 3 * 64 * 3 // 8
    codes = state["k.out"].numel() * 8
    assert codes == 2 * 256 * (d // 8) * (4 + 4 + 2)
    metadata = sum(t.numel() * t.element_size() * 8 for n, t in state.items() if n.startswith("k.2."))
    assert metadata == 2 * (256 // 128) * kept * 2 * 16
    assert prepared["k.1.basis"].shape == (2, d, kept) and prepared["k.1.basis"].dtype == torch.float16
    assert prepared["k.1.mean"].shape == (2, d)
    keys_bits = pipe.bits_per_value(3, 64).keys
    assert keys_bits == pytest.approx(1.25 + 2 * 16 * kept / (128 * d))


def test_pads_stay_out_of_the_basis_and_ranges():
    keys = _keys(1, 2, 96, 16, 0.1, 3)
    padded = torch.cat([torch.randn(1, 2, 32, 16) * 50, keys], 2)
    valid = torch.cat([torch.zeros(1, 32, dtype=torch.bool), torch.ones(1, 96, dtype=torch.bool)], 1)
    proj = T.project("svd", keep=0.5, basis_dtype="float32")
    alone = proj.prepare(keys, Context(dim=16))
    with_pads = proj.prepare(padded, Context(dim=16, valid=valid))
    torch.testing.assert_close(with_pads["mean"], alone["mean"], rtol=1e-5, atol=1e-5)
    # the kept subspace is the same (basis columns up to sign)
    overlap = (with_pads["basis"].transpose(1, 2) @ alone["basis"]).abs()
    torch.testing.assert_close(overlap, torch.eye(16)[None], rtol=0, atol=1e-3)


def test_generated_tokens_stay_full_precision_or_follow_the_prompt_basis():
    """S7: `generated="fp"` keeps every token after the prompt in the window; "project" encodes them."""
    rope = lambda positions: (torch.ones(*positions.shape, 16), torch.zeros(*positions.shape, 16))  # noqa: E731
    keys = _keys(1, 2, 400, 16, 0.1, 0)
    for generated, encoded in (("fp", 256), ("project", 384)):
        pipe = KVPipeline.from_preset("svdq-2bit", generated=generated, compile=False)
        store = KVStore(pipe, rope=rope)
        store.append(keys[:, :, :300], keys[:, :, :300])
        for i in range(300, 400):
            store.append(keys[:, :, i : i + 1], keys[:, :, i : i + 1])
        assert store.n_encoded == encoded and store.length == 400
        hk, hv = store.history()
        torch.testing.assert_close(hk[:, :, encoded:], keys[:, :, encoded:], rtol=0, atol=0)


def test_bad_schedules_and_options_are_clear():
    with pytest.raises(ValueError, match="truncated"):
        KVPipeline.from_preset("svdq-2bit", schedule=(8, 0, 4, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="generated="):
        KVPipeline.from_preset("svdq-2bit", generated="drop")
    with pytest.raises(ValueError, match="each width"):
        T.quantize("schedule", bits=(9,))
    with pytest.raises(ValueError, match="generated='fp' with sparse"):
        KVPipeline.from_preset("svdq-1.25bit-sparse", generated="project")


def _filled_sparse_store(ratio, prompt=520, seed=0):
    rope = lambda positions: (torch.ones(*positions.shape, 16), torch.zeros(*positions.shape, 16))  # noqa: E731
    keys = _keys(1, 2, prompt, 16, 0.1, seed)
    values = torch.randn(1, 2, prompt, 16, generator=torch.Generator().manual_seed(seed))
    store = KVStore(KVPipeline.from_preset("svdq-1.25bit-sparse", sparse=ratio, compile=False), rope=rope)
    store.append(keys, values)
    return store, keys


@given(seed=st.integers(0, 1000), n=st.integers(1, 40))
def test_gathered_rows_equal_the_full_reconstruction_at_those_rows(seed, n):
    """Q16: reconstructing only selected rows equals reconstructing all and then selecting them."""
    store, _ = _filled_sparse_store(32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, store.n_encoded, (1, 2, n), generator=g)
    k_rows, v_rows = store.gather_encoded(tokens)
    k_all, v_all = store.decode_encoded()
    index = tokens[..., None].expand(-1, -1, -1, 16)
    torch.testing.assert_close(k_rows, k_all.gather(2, index), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_rows, v_all.gather(2, index), rtol=0, atol=0)


def test_selection_reads_one_chunk_in_ratio_with_the_outliers_always_among_them():
    store, _ = _filled_sparse_store(8)
    selector = store.pipeline.selector
    own = {n[4:]: t for n, t in store.prepared.items() if n.startswith("k.0.")}
    q = torch.randn(1, 6, 3, 16)
    tokens = selector.select(q, own, store.n_encoded, 0.25)
    chunks = store.n_encoded // 8
    assert tokens.shape == (1, 2, math.ceil(chunks / 8) * 8)
    picked = tokens[..., ::8] // 8
    outliers = (-own["coherence"][:, :, :chunks].float()).topk(math.ceil(math.ceil(chunks / 8) * 3 / 16)).indices
    for h in range(2):
        assert set(outliers[0, h].tolist()) <= set(picked[0, h].tolist())


def test_skipped_chunks_are_not_read_and_a_full_budget_is_dense_attention():
    """Q17, and the sparse step's output does not depend on the codes of chunks it did not select."""
    from torchkv.models.attention import _sparse
    from torchkv.models.mask import MaskSpec
    from transformers.masking_utils import causal_mask_function

    spec = MaskSpec(causal_mask_function, None, 520)
    q = torch.randn(1, 6, 1, 16)
    k_new, v_new = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    store, _ = _filled_sparse_store(32)
    out = _sparse(q, store, k_new, v_new, spec, 0.25, None)
    own = {n[4:]: t for n, t in store.prepared.items() if n.startswith("k.0.")}
    chosen = store.pipeline.selector.select(q, own, store.n_encoded, 0.25)
    untouched = torch.ones(store.n_encoded, dtype=torch.bool)
    untouched[chosen.flatten()] = False
    for name in ("k.out", "v.out"):  # scramble the codes of every unselected token
        store.encoded[name][:, :, untouched] = 255 - store.encoded[name][:, :, untouched]
    torch.testing.assert_close(_sparse(q, store, k_new, v_new, spec, 0.25, None), out, rtol=0, atol=0)

    dense_store, _ = _filled_sparse_store(1)
    k_old, v_old = dense_store.history()
    keys, values = torch.cat([k_old, k_new], 2), torch.cat([v_old, v_new], 2)
    reference = torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(_sparse(q, dense_store, k_new, v_new, spec, 0.25, None), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text"])
def test_full_budget_sparse_equals_dense_on_padded_batches_and_sliding_windows(arch):
    """Padding and sliding windows reach the sparse step as the model's mask at the selected tokens' absolute
    positions: with every chunk selected (sparse=1), a left-padded batch through a sliding-window model gives the
    dense cache's logits. The landmarks of a chunk are over its real tokens; a chunk of padding alone is never
    picked, so a 1/4 budget still generates."""
    import torchkv
    from torchkv.testing import tiny_model

    model = tiny_model(arch, sliding_window=200) if arch != "llama" else tiny_model(arch)
    ids = torch.randint(3, 128, (2, 330), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :150] = 0  # more than one whole chunk (128) of padding
    logits = {}
    for name, preset, options in (("dense", "svdq-1.25bit", {"residual": 32}),
                                  ("full", "svdq-1.25bit-sparse", {"sparse": 1}),
                                  ("quarter", "svdq-1.25bit-sparse", {"sparse": 4})):
        with torchkv.patched(model, KVPipeline.from_preset(preset, compile=False, **options)), torch.no_grad():
            cache = torchkv.new_cache(model)
            model(ids[:, :300], attention_mask=mask[:, :300], **cache_argument(model, cache))
            # row groups: the unpadded row holds 256 encoded tokens; the padded one, 150 tokens, holds none, as alone
            assert [s.n_encoded for s in cache.layers[0].stores()] in ([256, 0], [0, 256])
            logits[name] = model(ids[:, 300:], attention_mask=mask,
                                 **cache_argument(model, cache)).logits.log_softmax(-1)
    torch.testing.assert_close(logits["full"], logits["dense"], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(logits["quarter"]).all()


@pytest.mark.model
@pytest.mark.eager_first  # the keys' error is the subject (svdq's compiled encode: tests/test_pipeline.py)
def test_smollm2_keys_svdq_beats_per_channel_2bit(smollm2):
    """The paper's central claim on real keys (512 held-out tokens, all 30 layers): svdq-2bit's key error
    is at least 2x lower than per-channel 2-bit quantization over the same 128-token ranges, and
    svdq-1.25bit's is lower too (figures for every preset: benchmarks/svdq_keys.py)."""
    from torchkv.corpora import documents
    from torchkv.eval.reconstruction import key_rel_error, per_channel_keys
    from torchkv.models.capture import capture_qkv

    model, tokenizer = smollm2
    _, layers = capture_qkv(model, documents(tokenizer, 512, 1))
    error = {name: key_rel_error(KVPipeline.from_preset(name), model, layers, 512)
             for name in ("svdq-2bit", "svdq-1.25bit")}
    baseline = key_rel_error(per_channel_keys(2, 128), model, layers, 512)
    assert 2 * error["svdq-2bit"] <= baseline, (error, baseline)
    assert error["svdq-1.25bit"] < baseline, (error, baseline)


@pytest.mark.model
def test_smollm2_sparse_attention_with_a_full_budget_is_the_dense_cache(smollm2):
    """Through the patched model: a 40-token block after a 560-token prompt gives the dense cache's logits
    when the budget covers every chunk (sparse=1). (The default 1/32 budget's quality is measured by
    `torchkv eval`'s retrieval at 4K.) Eager: the selection is the subject (svdq's compiled encoders, sparse ones
    included, are tested in tests/test_pipeline.py)."""
    import torchkv
    from torchkv.corpora import documents

    model, tokenizer = smollm2
    ids = documents(tokenizer, 600, 1)
    logits = {}
    for name, options in (("dense", {"residual": 32}), ("full", {"sparse": 1})):
        preset = "svdq-1.25bit" if name == "dense" else "svdq-1.25bit-sparse"
        with torchkv.patched(model, KVPipeline.from_preset(preset, compile=False, **options)):
            cache = torchkv.new_cache(model)
            model(ids[:, :560], **cache_argument(model, cache))
            logits[name] = model(ids[:, 560:], **cache_argument(model, cache)).logits[0].log_softmax(-1)
    torch.testing.assert_close(logits["full"], logits["dense"], rtol=1e-3, atol=1e-3)
