"""Frontier: centred post-RoPE HIGGS codes read directly by decode; measured bits; channel medians; SmolLM2."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchkv
import torchkv.transforms as T
from torchkv.corpora import documents
from torchkv.eval.reconstruction import key_rel_error
from torchkv.methods.frontier import PRESETS
from torchkv.models.capture import capture_qkv
from torchkv.pipeline import Chain, KVPipeline, LayerState
from torchkv.ops import apply_rope
from torchkv.testing import capture_kv, rope_tables, sqnr
from torchkv.transforms import Context

#: SmolLM2's cache shape: 30 layers of 3 KV heads x 64
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


#: frontier-2bit keeps one float8 key norm per token and KV head (2.125 bits), not one per token (2.08 bits):
#: with a shared norm it answered 0 of 20 pass-key cases at 4K (benchmarks/results/frontier/retrieval_4k_ablation.txt)
@pytest.mark.parametrize("name,limit", [("frontier-2bit", 2.125), ("frontier-2.5bit", 2.5), ("frontier-3bit", 3.0)])
def test_measured_bits_meet_the_preset_budgets(name, limit):
    """Stored bits per value over all layers, scales included, from the real encoded tensors."""
    bits = KVPipeline.from_preset(name).bits_per_value(KV_HEADS, HEAD_DIM, layers=LAYERS)
    assert PRESETS[name][0] - 0.25 <= bits.mean <= limit


#: what `explain` says of every layer of a frontier pipeline
STORED_FORM = ("every layer: keys scored from the stored form; values summed from the stored form; on CUDA the Triton "
               "kernel over grid-coded keys")


@pytest.mark.parametrize("name", PRESETS)
def test_every_layer_is_read_from_its_stored_form(name):
    pipe = KVPipeline.from_preset(name)
    for layer in range(LAYERS):
        assert pipe.for_layer(layer).fused
    assert pipe.explain(LAYERS) == STORED_FORM


def test_an_unshipped_width_lists_the_shipped_grids():
    with pytest.raises(ValueError, match=r"bits=5, dim=4 has no shipped grid; allowed: .*\(bits=2, dim=4\)"):
        KVPipeline.from_preset("frontier-2bit", bits=5)


@pytest.mark.parametrize("key_bits,dim", [(2.5, 2), (3, 2), (3.5, 2), (4, 2)])
def test_keys_may_take_more_bits_than_values(key_bits, dim):
    """`key_bits` widens the keys alone (the retrieval ablation of issue 41): their grid is the widest with that many
    bits and values keep `bits`. Both are still scored from their codes: 8-bit codes of 2-D points (4 bits), and
    5-, 6- and 7-bit ones (2.5, 3 and 3.5 bits) packed in words."""
    pipe = KVPipeline.from_preset("frontier-2bit", key_bits=key_bits)
    higgs = next(t for t in pipe.keys.transforms if t.name == "higgs")
    assert (higgs.config.bits, higgs.config.dim) == (key_bits, dim)
    bits = pipe.bits_per_value(KV_HEADS, HEAD_DIM, layers=LAYERS)
    assert (bits.keys, bits.values) == (key_bits + 8 / HEAD_DIM, 2 + 8 / HEAD_DIM)
    assert pipe.explain(LAYERS) == STORED_FORM


def test_one_bit_keys_take_the_8d_grid_and_are_still_scored_from_their_codes():
    """No 4-D grid has 1 bit per value, so 1-bit keys use the 8-D one (256 points): 1 bit of codes plus one float8
    norm per 64 values."""
    pipe = KVPipeline.from_preset("frontier-2bit", bits=1)
    higgs = next(t for t in pipe.keys.transforms if t.name == "higgs")
    assert (higgs.config.bits, higgs.config.dim) == (1, 8)
    assert pipe.explain(LAYERS) == STORED_FORM
    bits = pipe.bits_per_value(KV_HEADS, HEAD_DIM, layers=LAYERS)
    assert bits.keys == bits.values == 1 + 8 / HEAD_DIM


@given(pads=st.integers(1, 20), seed=st.integers(0, 1000))
def test_channel_medians_ignore_padding(pads, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, 40, 16, generator=g)
    padded = torch.cat([1e4 * torch.randn(1, 2, pads, 16, generator=g), x], 2)
    valid = torch.arange(pads + 40)[None] >= pads
    center = T.predict("center")
    expected = center.prepare(x, Context(dim=16))["center"]
    torch.testing.assert_close(center.prepare(padded, Context(dim=16, valid=valid))["center"], expected, rtol=0, atol=0)


@given(offset=st.floats(2.0, 50.0), seed=st.integers(0, 1000))
def test_centring_removes_what_per_token_codes_would_spend_their_bits_on(offset, seed):
    """Keys with a large per-channel offset (as after a key norm): the centred HIGGS code is several dB better."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 1, 256, 64, generator=g) + offset * torch.randn(64, generator=g)
    errors = {}
    for centred in (False, True):
        chain = Chain([*([T.predict("center")] if centred else []), T.quantize("higgs", bits=2, dim=4), T.pack()])
        prepared = chain.prepare(k, LayerState({}, {}, {}), None) if centred else {}
        own = LayerState({}, prepared, {})
        khat = chain.decode(chain.encode(k, own, None), 64, own)
        errors[centred] = sqnr(k, khat)
    assert errors[True] > errors[False] + 6


@given(offset=st.floats(2.0, 50.0), seed=st.integers(0, 1000))
def test_a_turned_offset_is_removed_by_rotary_centring_only(offset, seed):
    """Post-RoPE keys whose pre-RoPE channels share a large offset: over 2K positions the offset turns, so the
    fixed centre leaves it in the codes and the turned one (`predict.rotary_center`) takes it out."""
    g = torch.Generator().manual_seed(seed)
    rope = rope_tables(1, 2048, 64)
    k = apply_rope(torch.randn(1, 1, 2048, 64, generator=g) + offset * torch.randn(64, generator=g),
                   rope["cos"], rope["sin"])
    errors = {}
    for centre in ("center", "rotary_center"):
        chain = Chain([T.predict(centre), T.quantize("higgs", bits=2, dim=4), T.pack()])
        own = LayerState({}, chain.prepare(k, LayerState({}, {}, rope), None), rope)
        errors[centre] = sqnr(k, chain.decode(chain.encode(k, own, None), 64, own))
    assert errors["rotary_center"] > errors["center"] + 6


def test_rotary_centring_is_one_of_two_centres_scored_from_codes_by_the_inductor_path():
    with pytest.raises(ValueError, match="center=True or rotary_center=True, not both"):
        KVPipeline.from_preset("frontier-2bit", center=True, rotary_center=True)
    pipe = KVPipeline.from_preset("frontier-2bit", rotary_center=True)
    assert pipe.requires >= {"cos", "sin"}
    assert pipe.keys.scores_stored and pipe.values.sums_stored
    if torchkv.pipeline.codec.triton_decode.triton is not None:  # the grid kernel adds the offsets per token
        assert pipe.codec.kernel(64) == ("grid", None)
    # decode attention reads positions only through the offsets, so by chunk; pre-RoPE keys are rebuilt per token
    assert pipe.codec.attention_rope == "chunks"
    assert KVPipeline.from_preset("frontier-2bit").codec.attention_rope is None
    assert KVPipeline.from_preset("squat-pre-2bit").codec.attention_rope == "tokens"


@given(chunks=st.integers(1, 3), seed=st.integers(0, 1000), rotary=st.sampled_from([16, 32]))
def test_rotary_centred_scores_from_codes_equal_the_rebuilt_keys(chunks, seed, rotary):
    """Scores read from the stored residual plus the per-token offset `q·R_t·μ` equal the rebuilt keys' (full and
    partial rotary)."""
    g = torch.Generator().manual_seed(seed)
    tokens = 32 * chunks
    rope = rope_tables(2, tokens, rotary)
    k = apply_rope(torch.randn(2, 3, tokens, 32, generator=g) + 4 * torch.randn(32, generator=g), rope["cos"],
                   rope["sin"])
    chain = Chain([T.predict("rotary_center"), T.project("balance"), T.quantize("higgs", bits=2, dim=4), T.pack()])
    queries = torch.randn(2, 6, tokens, 32, generator=g)
    own = LayerState({}, chain.prepare(k, LayerState({}, {}, {**rope, "queries": queries}), None), rope)
    state = chain.encode(k, own, None)
    k_hat = chain.decode(state, 32, own)
    q = torch.randn(2, 3, 2, 32, generator=g)
    by_chunk = {n: t.unflatten(2, (chunks, -1)) for n, t in state.items()}
    scores = chain.scores(q, by_chunk, 32, own)
    torch.testing.assert_close(scores.flatten(-2), q @ k_hat.transpose(-1, -2), rtol=1e-4, atol=1e-3)


@given(offset=st.floats(2.0, 20.0), chunks=st.integers(1, 3), seed=st.integers(0, 1000))
def test_centred_values_are_summed_from_their_codes_with_the_median_added_once(offset, chunks, seed):
    """`value_center`: values with a shared per-channel offset lose it before the rotated per-token code, so the
    code is better, and decode's weighted sum of the stored residual plus `μ·Σ p` equals that of the rebuilt
    values."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(2, 3, 32 * chunks, 32, generator=g) + offset * torch.randn(32, generator=g)
    pipe = KVPipeline.from_preset("frontier-2bit", value_center=True)
    assert [t.name for t in pipe.values.transforms] == ["center", "hadamard", "uniform", "bits"]
    assert pipe.values.sums_stored and pipe.explain(LAYERS) == STORED_FORM
    chain = pipe.values
    own = LayerState({}, chain.prepare(v, LayerState({}, {}, {}), None), {})
    state = chain.encode(v, own, None)
    v_hat = chain.decode(state, 32, own)
    plain = Chain([T.rotate("hadamard"), *chain.transforms[2:]])
    plain_own = LayerState({}, {}, {})
    assert sqnr(v, v_hat) > sqnr(v, plain.decode(plain.encode(v, plain_own, None), 32, plain_own)) + 3
    p = torch.rand(2, 3, 2, chunks, 32, generator=g) / (32 * chunks)  # weights summing to below one
    by_chunk = {n: t.unflatten(2, (chunks, -1)) for n, t in state.items()}
    torch.testing.assert_close(chain.weighted_sum(p, by_chunk, 32, own), p.flatten(-2) @ v_hat, rtol=1e-4, atol=1e-4)


def test_unbiased_values_refit_only_the_value_scales_and_are_still_read_from_their_codes():
    """`unbiased_values`: every layer's value quantizer (wide layers too) refits its scales; keys keep the
    MSE-optimal ones (unbiased keys lost 0.8-3.0 points on SmolLM2, stop 90); stored bits are unchanged."""
    pipe = KVPipeline.from_preset("frontier-2.5bit", unbiased_values=True)
    for layer in (0, LAYERS - 1):
        chains = pipe.for_layer(layer)
        assert [t.config.unbiased for t in chains.values.transforms if t.kind == "quantize"] == [True]
        assert [t.config.unbiased for t in chains.keys.transforms if t.kind == "quantize"] == [False]
    assert pipe.explain(LAYERS) == STORED_FORM
    plain = KVPipeline.from_preset("frontier-2.5bit")
    assert pipe.bits_per_value(KV_HEADS, HEAD_DIM, layers=LAYERS) == plain.bits_per_value(KV_HEADS, HEAD_DIM,
                                                                                          layers=LAYERS)


@pytest.mark.model
@pytest.mark.eager_first
def test_real_keys_quantize_better_on_the_4d_grid_and_decode_reads_them(smollm2):
    """SmolLM2's post-RoPE keys and values: the 4-D grid beats the 2-D grid at the same bits, and a patched
    generate() runs with every layer read from its stored form."""
    model, tokenizer = smollm2
    ids = tokenizer("The history of the city begins " * 60, return_tensors="pt").input_ids[:, :320]
    layers = capture_kv(model, ids)
    for side in (0, 1):
        x = torch.cat([kv[side] for kv in layers[1::6]], 1)  # 5 layers' heads
        quality = {}
        for dim in (2, 4):
            chain = Chain([T.quantize("higgs", bits=2, dim=dim), T.pack()])
            own = LayerState({}, {}, {})
            quality[dim] = sqnr(x, chain.decode(chain.encode(x, own, None), 64, own))
        assert quality[4] > quality[2] + 0.3, quality
    with torchkv.patched(model, "frontier-2.5bit"), torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 328)


@pytest.mark.model
def test_unbiased_values_undo_the_shrinkage_of_real_values(smollm2):
    """SmolLM2's values of held-out code through `frontier-2bit`'s value chain: the MSE-optimal 2-bit code keeps
    under 0.92 of each row (`v·v̂ / ‖v‖²`), the refitted one about all of it (float8 scales round each row's
    factor), with the same codes; a patched generate() reads them."""
    model, tokenizer = smollm2
    ids = documents(tokenizer, 256, 1, "eval", "code")
    v = torch.cat([kv[1] for kv in capture_kv(model, ids)[1::6]], 1)  # 5 layers' heads
    kept, codes = {}, {}
    for unbiased in (False, True):
        chain = KVPipeline.from_preset("frontier-2bit", unbiased_values=unbiased).values
        own = LayerState({}, {}, {})
        state = chain.encode(v, own, None)
        kept[unbiased] = ((v * chain.decode(state, HEAD_DIM, own)).sum(-1) / v.square().sum(-1)).mean().item()
        codes[unbiased] = state["out"]
    assert torch.equal(codes[True], codes[False])
    assert kept[False] < 0.92 and abs(kept[True] - 1) < 0.03, kept
    with torchkv.patched(model, "frontier-2bit:unbiased_values=True"), torch.no_grad():
        assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 260)


@pytest.mark.model
def test_rotary_centring_cuts_real_key_error_by_a_third(smollm2):
    """SmolLM2's keys of held-out code: turning each head's pre-RoPE median to the key's position before the 2-bit
    code cuts the key error by more than a third (0.30 -> 0.15 at 1K, `prediction_headroom_smollm2.json`)."""
    model, tokenizer = smollm2
    _, layers = capture_qkv(model, documents(tokenizer, 256, 1, "eval", "code"))
    errors = {}
    for rotary in (False, True):
        pipe = KVPipeline.from_preset("frontier-2bit", rotary_center=rotary)
        pipe.compile = False
        errors[rotary] = key_rel_error(pipe, model, layers, 256)
    assert errors[True] < 0.65 * errors[False], errors


@torch.no_grad()
def test_a_text_fed_one_token_at_a_time_from_a_lone_first_token_loses_no_more_than_in_blocks(smollm2):
    """SmolLM2 fed 400 tokens one at a time from a one-token prompt (generation from a lone BOS): frontier-2bit's
    balance scales wait for a chunk of tokens, so its perplexity is that of 64-token blocks (15.25 against 15.23;
    scales taken from the first token alone gave 46)."""
    from torchkv.eval.perplexity import perplexity
    from torchkv.eval.rows import method

    model, tokenizer = smollm2
    docs, row = documents(tokenizer, 400, 1, domain_name="wiki"), method("frontier-2bit")
    by_token = perplexity(model, docs, row, block=1, progress=False)
    assert by_token < 1.02 * perplexity(model, docs, row, block=64, progress=False)
