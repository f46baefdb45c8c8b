"""AQUA-KV: ridge calibration (spec §3.1), the closed-loop encode/decode across layers (§3.5), the cache's
cross-layer hand-over, calibration errors, and calibration + the compressed cache on SmolLM2."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchkv
import torchkv.transforms as T
from torchkv.models import cache_argument
from torchkv.ops import apply_rope, ridge_streamed
from torchkv.pipeline import KVPipeline
from torchkv.store import CrossLayer, KVStore


def _rows(x):
    return x.transpose(1, 2).flatten(2).flatten(0, 1)


@given(n=st.integers(40, 200), din=st.integers(1, 12), dout=st.integers(1, 6), splits=st.integers(1, 7),
       seed=st.integers(0, 10_000))
def test_ridge_streamed_is_least_squares_at_zero_damping_whatever_the_batches(n, din, dout, splits, seed):
    """§3.1 items 1 and 5: α = 0 equals lstsq on [z, 1]; the batch split does not matter."""
    g = torch.Generator().manual_seed(seed)
    z, y = torch.randn(n, din, generator=g, dtype=torch.float64), torch.randn(n, dout, generator=g, dtype=torch.float64)
    w, b = ridge_streamed(zip(z.tensor_split(splits), y.tensor_split(splits)), alpha=0.0)
    theta = torch.linalg.lstsq(torch.cat([z, torch.ones(n, 1, dtype=torch.float64)], 1), y).solution
    assert torch.allclose(w.double(), theta[:-1], atol=1e-5) and torch.allclose(b.double(), theta[-1], atol=1e-5)


@given(alpha=st.floats(1e-4, 1.0), seed=st.integers(0, 10_000))
def test_ridge_streamed_solves_the_damped_normal_equations_and_shrinks(alpha, seed):
    """§3.1 items 2 and 6: (Z̃ᵀZ̃ + λI')Θ = Z̃ᵀY with λ = α·mean diag(Z̃ᵀZ̃) (intercept unpenalised); ‖W‖ falls with α."""
    g = torch.Generator().manual_seed(seed)
    z, y = 3 * torch.randn(300, 8, generator=g) + 1, torch.randn(300, 5, generator=g)
    w, b = ridge_streamed([(z, y)], alpha)
    zt = torch.cat([z.double(), torch.ones(300, 1, dtype=torch.float64)], 1)
    gram = zt.T @ zt
    penalty = torch.full((9,), alpha * float(gram.diagonal().mean()), dtype=torch.float64)
    penalty[-1] = 0
    theta = torch.cat([w.double(), b.double()[None]])
    residual = (gram + torch.diag(penalty)) @ theta - zt.T @ y.double()
    assert residual.norm() <= 1e-4 * (zt.T @ y.double()).norm()
    w_more, _ = ridge_streamed([(z, y)], 2 * alpha)
    assert w_more.norm() <= w.norm() + 1e-6


def _aqua(bits=2, chunk=8):
    return KVPipeline.from_preset(f"aquakv-{bits}bit", sinks=0, residual=0, chunk=chunk, compile=False)


def _fit_random(pipe, layers, kv_heads, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    d = kv_heads * head_dim
    for t in pipe.keys.transforms + pipe.values.transforms:
        if t.kind == "predict":
            din = d * len(t.config.sources)
            for layer in range(1, layers):
                t.fit_layer(layer, torch.randn(din, d, generator=g) / math.sqrt(din), torch.randn(d, generator=g))


def _layers(pipe, k, v, rope):
    """Encode layer after layer (closed loop), then decode layer after layer from the stored state alone."""
    cos, sin = rope
    carry, states, encode_carry = {}, [], []
    for layer in range(k.shape[0]):
        lp = pipe.for_layer(layer)
        state = lp.encode_chunk(k[layer], v[layer], layer=layer, inputs={"cos": cos, "sin": sin, **carry})
        carry = {f"previous.{s}": state.pop(f"carry.{s}") for s in "kv"}
        encode_carry.append(carry)
        states.append(state)
    out, carry = [], {}
    for layer, state in enumerate(states):
        kh, vh, c = pipe.for_layer(layer).decode_chunk(state, head_dim=k.shape[-1], layer=layer,
                                                       inputs={"cos": cos, "sin": sin, **carry})
        carry = {f"previous.{s}": t for s, t in c.items()}
        out.append((kh, vh, carry))
    return encode_carry, out


@given(seed=st.integers(0, 10_000), bits=st.sampled_from([2, 3]))
def test_decoding_layer_after_layer_reproduces_what_encoding_saw_so_errors_do_not_compound(seed, bits):
    """§3.5 (Alg. 2/3 closed loop): the decoder's reconstruction of every layer equals the encoder's, and each
    layer's key error is exactly the quantizer's error on its residual `R = K − f(K̂_{ℓ−1})`."""
    layers, b, h, t, d = 4, 1, 2, 8, 16
    pipe = _aqua(bits)
    _fit_random(pipe, layers, h, d, seed)
    g = torch.Generator().manual_seed(seed + 1)
    k, v = torch.randn(layers, b, h, t, d, generator=g), torch.randn(layers, b, h, t, d, generator=g)
    angle = torch.rand(b, t, d // 2, generator=g) * 6
    rope = (torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1))
    encode_carry, decoded = _layers(pipe, k, v, rope)
    for layer in range(layers):
        enc, (kh, vh, dec) = encode_carry[layer], decoded[layer]
        assert torch.allclose(enc["previous.k"], dec["previous.k"], atol=1e-5)
        assert torch.allclose(enc["previous.v"], dec["previous.v"], atol=1e-5)
        # decoded keys are the carried pre-RoPE reconstruction rotated back to each token's position
        assert torch.allclose(kh, apply_rope(dec["previous.k"], *rope), atol=1e-5)
        assert torch.equal(vh, dec["previous.v"])  # values have no position-dependent transform
        if layer:
            k_pre = apply_rope(k[layer], rope[0], -rope[1])
            w, bias = (pipe.keys.transforms[1].layer_params(layer)[n].float() for n in ("weight", "bias"))
            prediction = (_rows(encode_carry[layer - 1]["previous.k"]) @ w + bias).view(b, t, h, d).transpose(1, 2)
            residual = k_pre - prediction
            q = KVPipeline(keys=[T.quantize("higgs", bits=bits), T.pack()], values=[T.quantize("cast")],
                           residual=0, compile=False)
            r_hat, _ = q.decode_chunk(q.encode_chunk(residual, residual), head_dim=d)
            assert torch.allclose(dec["previous.k"] - k_pre, r_hat - residual, atol=1e-4)


def test_an_exact_predictor_leaves_only_the_quantizer_error_on_a_zero_residual():
    """§3.5: with K_ℓ = K̂_{ℓ−1}·A + b exactly, the residual is 0, HIGGS stores 0 (no NaN: the reference code
    divides by the norm) and the reconstruction is exact up to the float16 rounding of the predictor."""
    pipe = KVPipeline(keys=[T.predict("linear", weight_dtype="float32"), T.quantize("higgs", bits=2), T.pack()],
                      values=[T.quantize("cast")], residual=0, compile=False)
    g = torch.Generator().manual_seed(0)
    prev = torch.randn(1, 2, 8, 16, generator=g)
    a, bias = torch.randn(32, 32, generator=g) / 6, torch.randn(32, generator=g)
    predictor = pipe.keys.transforms[0]
    predictor.fit_layer(1, a, bias)
    k = (predictor.features({"previous": prev}) @ a + bias).view(1, 8, 2, 16).transpose(1, 2)
    state = pipe.encode_chunk(k, k, layer=1, inputs={"previous.k": prev})
    kh, _, _ = pipe.decode_chunk(state, head_dim=16, layer=1, inputs={"previous.k": prev})
    assert not kh.isnan().any() and torch.allclose(kh, k, atol=1e-5)


@given(seed=st.integers(0, 10_000))
def test_zero_predictors_store_exactly_what_higgs_alone_stores(seed):
    """§3.5 item 26: W = 0, b = 0 gives the codes of the ablation without predictors, at every layer."""
    layers, d = 3, 16
    pipe, plain = _aqua(), KVPipeline.from_preset("aquakv-2bit-nopred", sinks=0, residual=0, chunk=8, compile=False)
    for t in pipe.keys.transforms + pipe.values.transforms:
        if t.kind == "predict":
            for layer in range(1, layers):
                t.fit_layer(layer, torch.zeros(2 * d * len(t.config.sources), 2 * d), torch.zeros(2 * d))
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(layers, 1, 2, 8, d, generator=g), torch.randn(layers, 1, 2, 8, d, generator=g)
    rope = {"cos": torch.ones(1, 8, d), "sin": torch.zeros(1, 8, d)}
    carry = {}
    for layer in range(layers):
        state = pipe.for_layer(layer).encode_chunk(k[layer], v[layer], layer=layer, inputs={**rope, **carry})
        carry = {f"previous.{s}": state.pop(f"carry.{s}") for s in "kv"}
        expected = plain.for_layer(layer).encode_chunk(k[layer], v[layer], layer=layer, inputs=rope)
        for side in "kv":
            def scale(st):
                return next(t for n, t in st.items() if n.startswith(f"{side}.") and n.endswith(".scale"))

            assert torch.equal(state[f"{side}.out"], expected[f"{side}.out"]) and torch.equal(scale(state), scale(expected))


def test_stores_hand_their_reconstruction_to_the_next_layer_and_refuse_another_order():
    layers = 3
    pipe = _aqua(chunk=32)
    pipe.residual, pipe.sinks = 8, 1
    _fit_random(pipe, layers, 2, 16, 0)
    g = torch.Generator().manual_seed(1)
    rope = lambda pos: (torch.ones(*pos.shape, 16), torch.zeros(*pos.shape, 16))  # noqa: E731 (identity RoPE)
    cross = CrossLayer(layers)
    stores = [KVStore(pipe, i, rope, cross) for i in range(layers)]
    k, v = torch.randn(layers, 1, 2, 100, 16, generator=g), torch.randn(layers, 1, 2, 100, 16, generator=g)
    for start, end in ((0, 70), (70, 71), (71, 100)):
        for i, store in enumerate(stores):
            store.append(k[i, :, :, start:end], v[i, :, :, start:end])
    assert {s.n_encoded for s in stores} == {64}
    histories = [s.history() for s in stores]  # layer order: each decodes from the previous layer's history
    cos, sin = torch.ones(1, 64, 16), torch.zeros(1, 64, 16)
    _, decoded = _layers(pipe, k[:, :, :, 1:65], v[:, :, :, 1:65], (cos, sin))
    for (hk, hv), (kh, vh, _) in zip(histories, decoded):
        assert torch.allclose(hk[:, :, 1:65], kh, atol=1e-5) and torch.allclose(hv[:, :, 1:65], vh, atol=1e-5)
    with pytest.raises(RuntimeError, match="layer 2 predicts from layer 1"):
        stores[2].history()
    with pytest.raises(ValueError, match="shared CrossLayer"):
        KVStore(pipe, 1, rope)


def test_layer_zero_follows_the_window_rules_of_a_modified_copy():
    """A copy with other window rules (`Method.new_cache(simulated=True)` zeroes residual and sinks) gets its
    own layer-0 pipeline; the original's is untouched."""
    import copy

    pipe = KVPipeline.from_preset("aquakv-2bit")
    first = pipe.for_layer(0)
    simulated = copy.copy(pipe)
    simulated.residual, simulated.sinks = 0, 0
    assert (simulated.for_layer(0).residual, simulated.for_layer(0).sinks) == (0, 0)
    assert pipe.for_layer(0) is first and (first.residual, first.sinks) == (128, 4)
    assert first.carries and first.keys.transforms[1].config.bits == 4 and not first.needs_fit


def test_bits_accounting_reproduces_the_papers_formula():
    """§1.8 / §3.5 item 35: b = (b_first + (L−1)·b_main)/L with b = log₂(n)/d + 16/g, measured on stored tensors.
    Llama-3.2-3B's shape (8 KV heads × 128, L = 28, one scale per token: g = 1024) gives the paper's 2.09."""
    paper = KVPipeline.from_preset("aquakv-2bit", span="token").bits_per_value(8, 128, layers=28)
    assert paper.keys == paper.values == pytest.approx((4 + 16 / 1024 + 27 * (2 + 16 / 1024)) / 28)  # 2.0871: "2.09"
    ours = KVPipeline.from_preset("aquakv-3bit").bits_per_value(3, 64, layers=30)  # SmolLM2, one scale per head
    assert ours.mean == pytest.approx((4 + 16 / 64 + 29 * (3 + 16 / 64)) / 30)


def test_presets_need_calibration_for_this_model_and_say_how(smollm2):
    model, _ = smollm2
    with pytest.raises(ValueError, match="uncalibrated.*torchkv calibrate"):
        torchkv.patch(model, "aquakv-2bit")
    pipe = KVPipeline.from_preset("aquakv-2bit")
    pipe.fitted_for = {**torchkv.models.arch.fingerprint(model), "kv_heads": 8}
    with pytest.raises(ValueError, match="calibrated for another model.*kv_heads"):
        torchkv.patch(model, pipe)
    pipe.fitted_for = torchkv.models.arch.fingerprint(model)
    with pytest.raises(ValueError, match="no fitted parameters for layers"):
        torchkv.patch(model, pipe)
    assert [p["name"] for p in torchkv.presets() if p["calibrate"]] == ["aquakv-2bit", "aquakv-2bit-keys", "aquakv-3bit"]
    torchkv.patch(model, "aquakv-2bit-nopred")  # nothing to fit
    torchkv.unpatch(model)
    with pytest.raises(ValueError, match="nothing to calibrate"):
        KVPipeline.from_preset("aquakv-2bit-nopred").fit(model, ["text"])
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        KVPipeline.from_preset("aquakv-2bit").fit(model, ["text"])


@pytest.mark.model
def test_calibration_on_smollm2_saves_loads_and_beats_no_predictor(smollm2, wiki_eval_text, tmp_path):
    """A small calibration (4 × 256 tokens of the calibration split): fitted predictors explain most of the
    keys, the calibrated pipeline round-trips through save/load, patches by folder, and its perplexity
    through the compressed cache beats HIGGS without predictors."""
    from torchkv.corpora import documents, split_articles
    from torchkv.eval.perplexity import perplexity
    from torchkv.eval.reconstruction import key_rel_error
    from torchkv.eval.rows import Method
    from torchkv.models.capture import capture_qkv

    model, tokenizer = smollm2
    pipe = KVPipeline.from_preset("aquakv-2bit", compile=False)
    texts = [text for _, text in split_articles("calibration")[:200]]
    report = pipe.fit(model, texts, tokenizer=tokenizer, seq_len=256, max_tokens=1024, progress=False)
    assert report["tokens"] == 1024 and [row["layer"] for row in report["layers"]] == list(range(30))
    # §3.5 item 24: the closed loop does not drift with depth; every layer beats HIGGS alone (Gaussian MSE 0.107)
    for row in report["layers"][1:]:
        assert row["keys"]["predictor_error"] < 0.5 and row["keys"]["error"] < 0.05 and row["values"]["error"] < 0.05
    d = 3 * 64  # §3.5 item 29: W_K (D, D), W_V (2D, D) and their biases for layers 1..L-1
    assert sum(t.numel() for t in pipe.params().values()) == 29 * (3 * d * d + 2 * d)
    pipe.save_pretrained(tmp_path)
    loaded = KVPipeline.from_pretrained(tmp_path)
    assert loaded.fitted_for == pipe.fitted_for and loaded.params().keys() == pipe.params().keys()
    assert all(torch.equal(t, pipe.params()[name]) for name, t in loaded.params().items())
    loaded.compile = False
    docs = documents(tokenizer, 1024, 1)
    ppl = {name: perplexity(model, docs, Method(name, pipeline=p), progress=False) for name, p in (
        ("aquakv", loaded), ("nopred", KVPipeline.from_preset("aquakv-2bit-nopred", compile=False)))}
    assert ppl["aquakv"] < ppl["nopred"], ppl
    # the reconstruction benchmark chains the layers' reconstructions the same way
    _, captured = capture_qkv(model, docs[:, :256])
    nopred = KVPipeline.from_preset("aquakv-2bit-nopred", compile=False)
    assert key_rel_error(loaded, model, captured, 256) < 0.5 * key_rel_error(nopred, model, captured, 256)
    with torchkv.patched(model, str(tmp_path)):
        torchkv.models.pipeline_of(model).compile = False  # eager: compiling here is the pipeline tests' job
        cache = torchkv.new_cache(model)
        ids = docs[:, :300]
        model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
        assert cache.layers[5].store.n_encoded == 300 - 4 - 128 - (300 - 4 - 128) % 32
        assert any(n.startswith("params.") for n in cache.layers[5].store.tensors())  # predictors counted


@pytest.mark.parametrize("arch", ["gemma2", "llama"])
def test_calibration_forward_is_the_models_own(arch):
    """Calibration records K/V while the model runs its own attention: with Gemma 2's logit soft-capping (which
    SDPA lacks) and with plain causal masks, the recording forward gives the model's logits."""
    from torchkv.fitting.calibrate import _recording
    from torchkv.testing import tiny_model

    model = tiny_model(arch, sliding_window=32) if arch == "gemma2" else tiny_model(arch)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        records: dict = {}
        with _recording(model, records):
            got = model(ids, use_cache=False).logits
    assert set(records) == {("call", 0), ("call", 1), ("kv", 0), ("kv", 1)}
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
