"""XQuant / XQuant-CL (spec xquant.md §3): weight factors, identity-quantizer exactness of every variant on tiny
MHA and GQA models, CL error feedback, the paper's memory formulas, and SmolLM2."""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchkv
import torchkv.transforms as T
from torchkv.methods.xquant import key_outlier_channels, xquant, xquant_cl
from torchkv.models import cache_argument
from torchkv.ops import weight_factors
from torchkv.pipeline import KVPipeline, LayerState
from torchkv.store import CrossLayer, KVStore
from torchkv.testing import rope_tables, tiny_model
from torchkv.transforms import Context, ProjectionWeights


def _fit(pipe: KVPipeline, weights: list[ProjectionWeights]) -> KVPipeline:
    pipe.fit_weights(weights)
    return pipe


def _weights(layers: int, d: int, kv: int, seed: int = 0, bias: bool = False) -> list[ProjectionWeights]:
    g = torch.Generator().manual_seed(seed)
    return [ProjectionWeights(torch.randn(d, kv, generator=g) / d**0.5, torch.randn(d, kv, generator=g) / d**0.5,
                              torch.randn(kv, generator=g) if bias else None, torch.randn(kv, generator=g) if bias else None)
            for _ in range(layers)]


# -- P4, P10: the weight factors and the CL projector ---------------------------------------------------------------


@given(d=st.integers(2, 40), n=st.integers(1, 40), seed=st.integers(0, 1000))
def test_weight_factors_reconstruct_and_project(d, n, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d, n, generator=g, dtype=torch.float64)
    u, r = weight_factors(w)
    rank = min(d, n)
    assert u.shape == (d, rank) and r.shape == (rank, n)
    torch.testing.assert_close(u @ r, w, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(u.T @ u, torch.eye(rank, dtype=torch.float64), rtol=0, atol=1e-10)
    x = torch.randn(5, d, generator=g, dtype=torch.float64)
    torch.testing.assert_close((x @ u) @ r, x @ w, rtol=1e-9, atol=1e-9)
    p = u @ u.T  # the projector onto the span of W's columns
    torch.testing.assert_close(p, p.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(p @ p, p, rtol=0, atol=1e-10)
    assert math.isclose(float(p.trace()), rank, abs_tol=1e-9)
    assert (rank < d) == (not torch.allclose(p, torch.eye(d, dtype=torch.float64)))


@given(d=st.integers(8, 48), kv=st.integers(4, 32), seed=st.integers(0, 1000))
def test_outlier_channel_predicted_from_the_weights(d, kv, seed):
    """P17: when X has a dominant component along u_0, the key channel of largest mean |K| is argmax |b_0|."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d, kv, generator=g, dtype=torch.float64)
    u, r = weight_factors(w)
    b0 = r[0].abs()
    if b0.topk(2).values[1] > 0.9 * b0.max():  # no clear margin between the two largest entries
        return
    x = 100 * torch.randn(64, 1, generator=g, dtype=torch.float64) * u[:, 0] + torch.randn(64, d, generator=g,
                                                                                        dtype=torch.float64)
    truth = (x @ w).abs().mean(0).argmax()
    assert key_outlier_channels(w, 1).item() == truth
    assert truth in key_outlier_channels(w, 3)


# -- P8, P9: the GQA-CL accumulator ----------------------------------------------------------------------------------


@given(layers=st.integers(2, 5), d=st.integers(8, 32), seed=st.integers(0, 1000))
def test_cl_subspace_accumulator_is_exact_on_keys_and_values_while_x_drifts(layers, d, seed):
    """Identity quantizer: `X̂_ℓ·W_kv = X_ℓ·W_kv` exactly although `X̂_ℓ ≠ X_ℓ`; the drift is the current delta's
    discarded part `−δ_ℓ(I − U Uᵀ)` (error feedback picks it up at the next layer)."""
    g = torch.Generator().manual_seed(seed)
    kv = max(1, d // 4)  # 2·d_kv < d: the projector is not the identity
    x = torch.randn(layers, 1, 1, 6, d, generator=g).cumsum(0)  # a residual-stream-like sequence of layer inputs
    acc = x[0]
    for layer, w in enumerate(_weights(layers, d, kv, seed)[1:], start=1):
        delta = T.predict("delta", subspace=True, basis_dtype="float32")
        delta.fit_weights(layer, w)
        ctx = Context(dim=d, params=delta.layer_params(layer), inputs={"previous": acc})
        z, _ = delta.encode(x[layer], ctx)
        assert z.shape[-1] == 2 * kv
        new = delta.decode(z, {}, ctx)
        w_kv = torch.cat([w.k, w.v], 1)
        scale = float(x[layer].abs().amax() * w_kv.abs().sum(0).amax())
        torch.testing.assert_close(new @ w_kv, x[layer] @ w_kv, rtol=0, atol=2e-5 * scale)
        u = delta.layer_params(layer)["basis"].double()
        step = (x[layer] - acc).double()
        drift = -(step - step @ u @ u.T)
        torch.testing.assert_close((new - x[layer]).double(), drift, rtol=0, atol=2e-5 * (1 + float(x.abs().amax())))
        assert drift.abs().amax() > 1e-3
        acc = new


@given(bits=st.integers(2, 4), seed=st.integers(0, 1000))
def test_cl_subspace_error_is_the_latent_error_through_sigma_b(bits, seed):
    """P9: `[K|V] − X·W_kv = (Ẑ − Z)·Σ·Bᵀ`, so its norm is at most `‖Ẑ − Z‖·σ_max(W_kv)`."""
    g = torch.Generator().manual_seed(seed)
    d, kv = 32, 4
    w = _weights(2, d, kv, seed)[1]
    w_kv = torch.cat([w.k, w.v], 1)
    prev, x = torch.randn(2, 1, 1, 64, d, generator=g)
    delta, quant = T.predict("delta", subspace=True, basis_dtype="float32"), T.quantize(bits=bits, axis="token", group=8)
    delta.fit_weights(1, w)
    ctx = Context(dim=d, params=delta.layer_params(1), inputs={"previous": prev})
    z, _ = delta.encode(x, ctx)
    codes, state = quant.encode(z, Context(dim=2 * kv))
    z_hat = quant.decode(codes, state, Context(dim=2 * kv))
    error = delta.decode(z_hat, {}, ctx) @ w_kv - x @ w_kv
    sigma_max = torch.linalg.matrix_norm(w_kv.double(), ord=2)
    assert error.double().norm() <= (z_hat - z).double().norm() * sigma_max * (1 + 1e-4) + 1e-5


# -- P6, P7: CL error feedback through the pipeline ------------------------------------------------------------------


@given(layers=st.integers(4, 7), bits=st.integers(2, 4), chunks=st.integers(1, 2), seed=st.integers(0, 1000))
def test_cl_error_is_one_quantization_at_every_depth(layers, bits, chunks, seed):
    """P7: `|X̂_ℓ − X_ℓ| ≤ Δ/2` of layer ℓ's own delta groups, however deep (MHA: no subspace, per-token deltas)."""
    g = torch.Generator().manual_seed(seed)
    heads, head_dim, chunk = 2, 16, 16
    d = heads * head_dim
    pipe = _fit(xquant_cl(bits, attention="mha", first_layers=1, token_group=16, group=chunk, residual=0),
                _weights(layers, d, d, seed, bias=True))
    pipe.compile = False
    t = chunk * chunks
    x = torch.randn(layers, 2, t, d, generator=g).cumsum(0)
    rope = rope_tables(2, t, head_dim)
    previous = {}
    for layer in range(layers):
        layer_pipe = pipe.for_layer(layer)
        k = v = torch.zeros(2, heads, t, head_dim)  # the chains cache X; their own inputs are not read
        state = layer_pipe.encode_chunk(k, v, layer=layer, inputs={**rope, "x": x[layer], **previous})
        x_hat = state["carry.k"][:, 0]  # [B, T, d], the running accumulator
        if layer:  # the delta's quantizer: pre_rope, weights, delta, quantize, pack
            step = state["k.3.scale"].float()[:, 0].repeat_interleave(16, -1)
            assert torch.all((x_hat - x[layer]).abs() <= step / 2 * (1 + 1e-5) + 1e-5)
        previous = {"previous.k": state["carry.k"], "previous.v": state["carry.v"]}


@given(layers=st.integers(2, 5), seed=st.integers(0, 1000))
def test_cl_telescopes_with_the_identity_quantizer(layers, seed):
    """P6: with an exact delta the accumulator is `X_base + Σ δ̂_j = X_ℓ` at every layer (MHA)."""
    g = torch.Generator().manual_seed(seed)
    d = 24
    x = torch.randn(layers, 1, 1, 8, d, generator=g, dtype=torch.float64).cumsum(0)
    acc, deltas = x[0].float(), []
    for layer in range(1, layers):
        t = T.predict("delta")
        ctx = Context(dim=d, inputs={"previous": acc})
        z, _ = t.encode(x[layer], ctx)
        deltas.append(z)
        acc = t.decode(z, {}, ctx)
        torch.testing.assert_close(acc.double(), x[layer], rtol=0, atol=1e-5)
        torch.testing.assert_close(acc, x[0].float() + sum(deltas), rtol=0, atol=1e-5)


# -- P3, P11: identity-quantizer exactness of every variant on tiny models ----------------------------------------


def _lossless(form: str, cross_layer: bool) -> KVPipeline:
    """An XQuant pipeline of `form` whose quantizers are exact float32 casts (float32 bases)."""

    def weights(**kw):
        return T.project("weights", basis_dtype="float32", **kw)

    def cast():
        return T.quantize("cast", dtype="float32")

    x_cache = ([T.rotate("pre_rope"), weights(side="k", basis="input"), cast()],
               [weights(side="v", basis="input", source="keys")])
    plain = x_cache if form == "mha" else ([T.rotate("pre_rope"), weights(side="k"), cast()], [weights(side="v"), cast()])
    if not cross_layer:
        return KVPipeline(*plain, residual=0, chunk=16, compile=False)
    delta = T.predict("delta", subspace=form == "gqa", basis_dtype="float32")
    keys = [T.rotate("pre_rope"), weights(side="k", basis="input"), delta, cast()]
    return KVPipeline(keys, x_cache[1], residual=0, chunk=16, compile=False, layers={0: plain, 1: x_cache})


@pytest.mark.parametrize("cross_layer", [False, True], ids=["xquant", "cl"])
@pytest.mark.parametrize("form,kv_heads,arch", [
    ("mha", 4, "llama"), ("gqa", 1, "llama"), ("gqa", 1, "qwen2"),
    ("gqa", 2, "qwen3"), ("gqa", 1, "gemma3_text"), ("mha", 4, "gemma3_text"), ("gqa", 2, "olmo2"),
    ("mha", 4, "olmo2"),
])
def test_identity_quantizer_rematerializes_exactly(form, kv_heads, arch, cross_layer):
    """Every stored token read back through its rematerialized K and V gives the model's own logits (queries
    included: simulated storage), and greedy generation is unchanged. qwen2 has K/V projection biases; qwen3 and
    gemma3 normalize each key head after the projection, olmo2 all key heads at once (the rebuilt keys go through
    that norm). With one KV head of 32 (g = 4), the GQA-CL subspace is 64 of X's 128 dimensions: not the
    identity on X."""
    model = tiny_model(arch, heads=4, kv_heads=kv_heads, layers=4)
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
        expected = model.generate(ids[:, :40], max_new_tokens=12, do_sample=False)
    with torchkv.patched(model, _lossless(form, cross_layer)):
        pipe = torchkv.pipeline_of(model)
        assert sum("weights" == t.name for t in pipe.keys.transforms) == 1
        if cross_layer and form == "gqa" and kv_heads == 1:
            assert pipe.keys.transforms[2].width == 64 < model.config.hidden_size
        cache = torchkv.new_cache(model, simulated=True)
        with torch.no_grad():
            logits = torch.cat([model(ids[:, :48], **cache_argument(model, cache), use_cache=True).logits,
                                *[model(ids[:, i : i + 1], **cache_argument(model, cache), use_cache=True).logits
                                  for i in range(48, 70)]], 1)
            generated = model.generate(ids[:, :40], max_new_tokens=12, do_sample=False)
        assert cache.layers[0].store.n_encoded == 64  # every whole chunk is stored in its cached form
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-4)
    assert torch.equal(generated, expected)


@given(form=st.sampled_from(["gqa", "mha"]), bias=st.booleans(), heads=st.integers(1, 3), chunks=st.integers(1, 3),
       seed=st.integers(0, 1000))
def test_values_summed_in_the_latent_equal_sums_of_rematerialized_values(form, bias, heads, chunks, seed):
    """Decode attention never forms V: `Σ_t p_t (ẑ_t·R + b) = (Σ_t p_t ẑ_t)·R_h + b_h·Σ_t p_t`, from the stored codes
    (GQA latent) or from the key chain's X̂ (MHA and CL value chains, which store nothing)."""
    d, head_dim, chunk = 24, 8, 4
    if form == "gqa":
        values = [T.project("weights", side="v", basis_dtype="float32"), T.quantize(bits=2, axis="token", group=4),
                  T.pack()]
    else:
        values = [T.project("weights", side="v", basis="input", source="keys")]
    pipe = _fit(KVPipeline([T.quantize("cast", dtype="float32")], values, residual=0, chunk=chunk),
                _weights(1, d, heads * head_dim, seed, bias))
    assert pipe.values.sums_stored
    g = torch.Generator().manual_seed(seed)
    t = chunks * chunk
    inputs = {"x": torch.randn(1, t, d, generator=g), "keys": torch.randn(1, 1, t, d, generator=g)}
    params = {n[2:]: p for n, p in pipe.layer_params(0).items() if n.startswith("v.")}
    own = LayerState(params, {}, inputs)
    state = pipe.values.encode(torch.zeros(1, heads, t, head_dim), own, None)
    rebuilt = pipe.values.decode(state, head_dim, own)  # [1, H, T, D]
    p = torch.rand(1, heads, 3, chunks, chunk, generator=g)
    by_chunk = {n: s.unflatten(2, (chunks, s.shape[2] // chunks)) for n, s in state.items()}
    got = pipe.values.weighted_sum(p, by_chunk, head_dim, own)
    torch.testing.assert_close(got, p.flatten(-2) @ rebuilt, rtol=1e-4, atol=1e-4)


# -- presets, the MHA/GQA choice, memory ----------------------------------------------------------------------------


@pytest.mark.eager_first
def test_auto_picks_mha_or_gqa_from_the_shapes_and_accounts_real_storage():
    for kv_heads, form, keys_bits, values_bits in ((4, "mha", 4 + 32 / 64, 0.0), (2, "gqa", 4 + 32 / 128, 4 + 32 / 64)):
        model = tiny_model(heads=4, kv_heads=kv_heads, layers=2)
        with torchkv.patched(model, "xquant-4bit"):
            pipe = torchkv.pipeline_of(model)
            assert pipe.options["attention"] == form
            bits = pipe.bits_per_value(kv_heads, 32)
            assert (bits.keys, bits.values) == (pytest.approx(keys_bits), pytest.approx(values_bits))
            cache = torchkv.new_cache(model)
            with torch.no_grad():
                model(torch.randint(0, 128, (1, 300)), **cache_argument(model, cache), use_cache=True)
            assert cache.encoded_bits_per_value() == pytest.approx(bits.mean)


def _normalized(pipe: KVPipeline, weights: list[ProjectionWeights], heads: int, head_dim: int, layers: int) -> Fraction:
    """Measured bits per value over `layers` layers, over FP16's 16 (layers past the first ones are alike: the
    main chains are fitted and measured at one of them)."""
    _fit(pipe, weights[:1] * min(layers, len(pipe.layer_chains) + 1))
    bits = pipe.bits_per_value(heads, head_dim, layers=layers)
    return Fraction(bits.mean).limit_denominator(1 << 20) / 16


def _round2(f: Fraction) -> Fraction:
    return Fraction(math.floor(f * 100 + Fraction(1, 2)), 100)  # round half up, as the paper's tables


def test_memory_matches_the_papers_formulas_at_their_shapes():
    """P14: measured stored bits at Llama-2-7B's (MHA) and Llama-3.1-8B's (GQA) shapes reproduce the "KV"
    columns of Tables 1 and 4 (FP16 scale and zero per 128 values), and the true GQA-CL base cost (A8)."""
    mha = _weights(1, 4096, 4096)  # fitting the MHA chains only takes views of W
    for bits, table1 in ((8, "0.26"), (4, "0.13"), (3, "0.10")):
        assert _round2(_normalized(xquant(bits, "mha", token_group=128), mha, 32, 128, 1)) == Fraction(table1)
    for bits, table4 in ((4, "0.13"), (3, "0.10"), (2, "0.08")):
        exact = Fraction(3 * 17, 4) + 29 * (bits + Fraction(1, 4))
        for pipe in (xquant(bits, "mha", first_layers=3, token_group=128), xquant_cl(bits, "mha", token_group=128)):
            measured = _normalized(pipe, mha, 32, 128, 32)
            assert measured == exact / (32 * 32) and _round2(measured) == Fraction(table4)
    gqa = _weights(1, 4096, 1024)
    for bits, table1 in ((4, "0.27"), (3, "0.20"), (2, "0.14")):
        assert _round2(_normalized(xquant(bits, "gqa", token_group=128), gqa, 8, 128, 1)) == Fraction(table1)
    measured = _normalized(xquant_cl(2, "gqa", token_group=128), gqa, 8, 128, 32)
    assert measured == (2 * Fraction(17, 4) + Fraction(17, 2) + 29 * Fraction(9, 4)) / (32 * 16)  # base: X, 4096 wide
    assert round(float(measured), 3) == 0.161


# -- store: prefill and decode give the same codes ------------------------------------------------------------------


def test_prefill_and_token_by_token_store_the_same_codes():
    """P12/P13: a store fed one prompt or the same tokens one at a time holds identical codes, and only whole
    chunks are encoded (the window keeps the rest with their layer inputs)."""
    layers, heads, head_dim, t = 3, 2, 16, 200
    d = heads * head_dim
    pipe = _fit(xquant_cl(2, attention="mha", first_layers=2, token_group=16, group=32, residual=32),
                _weights(layers, d, d))
    pipe.compile = False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(layers, 1, t, d, generator=g)
    k = v = torch.randn(1, heads, t, head_dim, generator=g)
    def rope(positions):  # positions [1, T] -> cos, sin [1, T, head_dim]
        tables = rope_tables(1, int(positions.max()) + 1, head_dim)
        return tables["cos"][:, positions[0]], tables["sin"][:, positions[0]]

    def fill(steps):
        cross = CrossLayer(layers)
        stores = [KVStore(pipe, i, rope, cross) for i in range(layers)]
        for start, end in steps:
            for i, store in enumerate(stores):
                store.append(k[:, :, start:end], v[:, :, start:end], inputs={"x": x[i, :, start:end]})
        return stores

    whole = fill([(0, t)])
    stepped = fill([(0, 100), *[(i, i + 1) for i in range(100, t)]])
    for layer, (a, b) in enumerate(zip(whole, stepped)):
        assert a.n_encoded == b.n_encoded and a.n_encoded % 32 == 0 and a.n_residual < 32 + 32
        for name in a.encoded:
            assert torch.equal(a.encoded[name], b.encoded[name]), name
        torch.testing.assert_close(b.recent.x[:, : b.n_residual], x[layer, :, b.n_encoded :])


# -- errors ---------------------------------------------------------------------------------------------------------


def test_clear_errors():
    with pytest.raises(ValueError, match="outliers= applies to the GQA latents"):
        xquant(2, attention="mha", outliers=1)
    with pytest.raises(ValueError, match="first_layers must be >= 1"):
        xquant_cl(2, first_layers=0)
    with pytest.raises(ValueError, match="attention='sparse'"):
        xquant(2, attention="sparse")
    with pytest.raises(ValueError, match=r"for_model\(model\)"):
        KVPipeline.from_preset("xquant-2bit").bits_per_value(3, 64)
    with pytest.raises(ValueError, match="source='keys'"):
        T.project("weights", side="v", source="keys")
    with pytest.raises(ValueError, match=r"group=64 must divide the feature size 32.*'token_group': 64"):
        torchkv.patch(tiny_model(heads=4, kv_heads=1), "xquant-2bit")  # a 32-wide value latent
    fitted = KVPipeline.from_preset("xquant-2bit", compile=False).for_model(tiny_model(heads=4, kv_heads=2))
    with pytest.raises(ValueError, match=r"pass inputs\['x'\]"):
        fitted.encode_chunk(torch.randn(1, 2, 128, 32), torch.randn(1, 2, 128, 32))


def test_outlier_channel_is_stored_in_float16():
    """App. B: latent channel 0 of the keys (largest singular value) kept in float16, the rest quantized."""
    model = tiny_model(heads=4, kv_heads=2, layers=2)
    pipe = KVPipeline.from_preset("xquant-2bit", outliers=1, compile=False).for_model(model)
    plain = KVPipeline.from_preset("xquant-2bit", compile=False).for_model(model)
    assert plain.bits_per_value(2, 32).keys == pytest.approx(2 + 32 / 128)
    # 63 two-bit codes pack into the same 16 bytes as 64; the float16 channel adds 16 bits per 64 values
    assert pipe.bits_per_value(2, 32).keys == pytest.approx((16 * 8 + 63 * 32 / 128 + 16) / 64)
    with torchkv.patched(model, pipe):
        cache = torchkv.new_cache(model)
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 300)), **cache_argument(model, cache), use_cache=True)
        store = cache.layers[1].store
        assert store.encoded["k.1.outliers"].dtype == torch.float16 and store.encoded["k.1.outliers"].shape[-1] == 1


# -- SmolLM2 --------------------------------------------------------------------------------------------------------


XQUANT_PRESETS = ["xquant-4bit", "xquant-3bit", "xquant-2bit", "xquant-cl-3bit", "xquant-cl-2bit"]


@pytest.fixture(scope="module")
def smollm2_errors(smollm2, wiki_eval_text):
    """Per preset: mean |Δ logit| vs the unpatched model on 64 tokens after a 512-token compressed prompt, the
    cache's measured bits, and the pipeline's."""
    model, tokenizer = smollm2
    ids = tokenizer(wiki_eval_text[:20_000], return_tensors="pt").input_ids[:, :576]
    with torch.no_grad():
        reference = model(ids).logits[:, 512:]
    out = {}
    for name in XQUANT_PRESETS:
        with torchkv.patched(model, KVPipeline.from_preset(name, compile=False)):
            cache = torchkv.new_cache(model)
            with torch.no_grad():
                model(ids[:, :512], **cache_argument(model, cache), use_cache=True)
                logits = model(ids[:, 512:], **cache_argument(model, cache), use_cache=True).logits
            pipe = torchkv.pipeline_of(model)
            out[name] = {"error": float((logits - reference).abs().mean()), "cache_bits": cache.encoded_bits_per_value(),
                         "bits": pipe.bits_per_value(3, 64, layers=30).mean, "form": pipe.options["attention"],
                         "nbytes": cache.nbytes(), "stores": [layer.store for layer in cache.layers]}
    return out


def test_smollm2_presets_are_gqa_and_order_by_bits(smollm2_errors):
    e = {name: r["error"] for name, r in smollm2_errors.items()}
    assert all(r["form"] == "gqa" for r in smollm2_errors.values())
    assert e["xquant-4bit"] < e["xquant-3bit"] < e["xquant-2bit"]
    assert e["xquant-cl-3bit"] < e["xquant-cl-2bit"] < e["xquant-2bit"]  # cross-layer deltas beat plain 2-bit
    for r in smollm2_errors.values():
        assert r["cache_bits"] == pytest.approx(r["bits"])


def test_smollm2_stores_only_the_cached_latents(smollm2_errors):
    """Nothing of K or V is held for encoded tokens: the value chain of CL layers stores nothing, the bases
    are counted, the model's own W_k/W_v (views) are not."""
    stores = smollm2_errors["xquant-cl-2bit"]["stores"]
    deep = stores[10].tensors()
    assert deep["encoded.v.out"].numel() == 0
    assert {n for n in deep if n.startswith("params.")} == {"params.k.2.basis"}  # U_kv; W_k, W_v are borrowed
    assert deep["params.k.2.basis"].shape == (576, 384) and deep["params.k.2.basis"].dtype == torch.float16
    latent = stores[0].tensors()
    assert {n for n in latent if n.startswith("params.")} == {"params.k.1.down", "params.k.1.up", "params.v.0.down",
                                                              "params.v.0.up"}


def test_compiled_equals_eager():
    """The compiled encode and rematerialization (first layers, base and delta layers) match eager execution."""
    model = tiny_model(heads=4, kv_heads=1, layers=4)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    results = []
    for compile in (False, True):
        with torchkv.patched(model, KVPipeline.from_preset("xquant-cl-2bit", token_group=32, compile=compile)):
            cache = torchkv.new_cache(model)
            with torch.no_grad():
                logits = [model(ids[:, :296], **cache_argument(model, cache), use_cache=True).logits[:, -1]]
                logits += [model(ids[:, i : i + 1], **cache_argument(model, cache), use_cache=True).logits[:, -1]
                           for i in range(296, 300)]
            results.append((torch.cat(logits), [layer.store.encoded for layer in cache.layers]))
    (eager, eager_codes), (compiled, compiled_codes) = results
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)
    for a, b in zip(eager_codes, compiled_codes):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a if a[n].dtype == torch.uint8)
