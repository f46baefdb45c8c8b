"""SQuat transforms, presets, compiled path, fused decode, and the mechanism on SmolLM2's real queries."""

import pytest
import torch

import torchkv
import torchkv.transforms as T
from torchkv.corpora import documents
from torchkv.eval.reconstruction import held_out_logit_error, reconstruct_prompt
from torchkv.models import cache_argument
from torchkv.ops import dequantize, quantize
from torchkv.pipeline import KVPipeline
from torchkv.testing import rope_tables
from torchkv.models.capture import capture_qkv


def _inputs(b=2, h=3, n_rep=3, t=64, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)
    k[..., 5] *= 10  # an outlier channel
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
    q = (torch.randn(b, h * n_rep, t, d, generator=g) * torch.logspace(0, -3, d)) @ rotation  # a few directions
    return k, v, q


@pytest.mark.parametrize("name", ["squat-2bit", "squat-pre-2bit"])
def test_compiled_encode_equals_eager(name):
    """The block-by-block quantizer compiles with fullgraph=True (T static) and gives the same bytes."""
    k, v, q = _inputs()
    inputs = {"queries": q, **(rope_tables(2, 64, 64) if name == "squat-pre-2bit" else {})}
    eager, compiled = KVPipeline.from_preset(name, compile=False), KVPipeline.from_preset(name)
    prepared = eager.prepare(k, v, inputs=inputs)
    se = eager.encode_chunk(k, v, prepared=prepared, inputs=inputs)
    sc = compiled.encode_chunk(k, v, prepared=prepared, inputs=inputs)
    assert se.keys() == sc.keys() and all(torch.equal(se[n], sc[n]) for n in se)
    for a, b in zip(eager.decode_chunk(se, head_dim=64, prepared=prepared, inputs=inputs),
                    compiled.decode_chunk(sc, head_dim=64, prepared=prepared, inputs=inputs)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_no_penalty_stores_exactly_kivis_keys():
    k, v, q = _inputs()
    squat = KVPipeline.from_preset("squat-2bit", lam=0.0, compile=False)
    kivi = KVPipeline.from_preset("kivi-2bit", residual=32, compile=False)
    state = squat.encode_chunk(k, v, prepared=squat.prepare(k, v, inputs={"queries": q}))
    reference = kivi.encode_chunk(k, v)
    assert torch.equal(state["k.out"], reference["k.out"]) and torch.equal(state["v.out"], reference["v.out"])
    assert torch.equal(state["k.1.scale"], reference["k.0.scale"])


def test_logit_error_on_the_prompt_queries_shrinks():
    """Keys' error seen by the prompt's own queries is smaller than KIVI's, and the key error itself larger."""
    k, v, q = _inputs(b=1)
    pipe = KVPipeline.from_preset("squat-2bit", lam=1.0, compile=False)
    state = pipe.encode_chunk(k, v, prepared=pipe.prepare(k, v, inputs={"queries": q}))
    k_squat = pipe.decode_chunk(state, head_dim=64)[0]
    k_kivi = dequantize(*quantize(k, 2, -2, 32), 2, -2, 32)
    rows = q.reshape(1, 3, -1, 64)  # the 3 query heads of each KV head, stacked
    logit_error = [(rows @ (kh - k).transpose(-1, -2)).abs().mean() for kh in (k_squat, k_kivi)]
    assert logit_error[0] < 0.9 * logit_error[1]
    assert (k_squat - k).norm() > (k_kivi - k).norm()


def test_fused_decode_attention_reads_the_codes():
    k, v, q = _inputs(b=1, t=128)
    pipe = KVPipeline.from_preset("squat-2bit")
    assert pipe.fused
    prepared = pipe.prepare(k, v, inputs={"queries": q})
    state = pipe.encode_chunk(k, v, prepared=prepared)
    k_hat, v_hat = pipe.decode_chunk(state, head_dim=64, prepared=prepared)
    encoded = {n: t.unflatten(2, (4, t.shape[2] // 4)) for n, t in state.items()}
    k_fp, v_fp = torch.randn(1, 3, 5, 64), torch.randn(1, 3, 5, 64)
    query = torch.randn(1, 9, 1, 64)
    out, _, _ = pipe.attend_decode(query, encoded, k_fp, v_fp, None, 0.125, prepared=prepared)
    keys, values = torch.cat([k_hat, k_fp], 2), torch.cat([v_hat, v_fp], 2)
    reference = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


def test_pads_stay_out_of_the_subspace_and_shared_mode_uses_the_first_row():
    k, v, q = _inputs(b=2, t=64)
    pipe = KVPipeline.from_preset("squat-2bit", compile=False)
    valid = torch.ones(2, 64, dtype=torch.bool)
    valid[1, :20] = False
    q_padded = q.clone()
    q_padded[1, :, :20] = 1e4  # garbage at the pads
    padded = pipe.prepare(k, v, valid=valid, inputs={"queries": q_padded})["k.0.updates"]
    alone = pipe.prepare(k[1:, :, 20:], v[1:, :, 20:], inputs={"queries": q[1:, :, 20:]})["k.0.updates"]
    torch.testing.assert_close(padded[1:], alone, rtol=1e-4, atol=1e-5)
    shared = KVPipeline.from_preset("squat-2bit", shared=True, compile=False).prepare(k, v, inputs={"queries": q})
    first = pipe.prepare(k[:1], v[:1], inputs={"queries": q[:1]})["k.0.updates"]
    assert torch.equal(shared["k.0.updates"][1], first[0]) and torch.equal(shared["k.0.updates"][0], first[0])


def test_bad_input_is_refused_clearly():
    k, v, q = _inputs()
    pipe = KVPipeline.from_preset("squat-2bit", compile=False)
    with pytest.raises(ValueError, match="needs the prompt's queries"):
        pipe.prepare(k, v)
    with pytest.raises(ValueError, match=r"reads \['updates'\] prepared by a transform before it"):
        KVPipeline([T.quantize("squat", bits=2), T.pack()], [T.quantize("cast")])
    with pytest.raises(ValueError, match="call prepared = pipe.prepare"):
        KVPipeline.from_preset("squat-2bit").encode_chunk(k, v)
    with pytest.raises(ValueError, match="block=24 must divide the head dimension 64"):
        KVPipeline.from_preset("squat-2bit", block=24).prepare(k, v, inputs={"queries": q})
    with pytest.raises(ValueError, match="rank=-1 must be a non-negative integer"):
        KVPipeline.from_preset("squat-2bit", rank=-1)
    with pytest.raises(ValueError, match="per channel"):
        T.quantize("squat", bits=2, axis="token")
    with pytest.raises(ValueError, match="do not match keys"):
        pipe.prepare(k, v, inputs={"queries": q[:, :4]})


@pytest.fixture(scope="module")
def real_qkv(smollm2):
    model, tokenizer = smollm2
    return capture_qkv(model, documents(tokenizer, 1024, 1))[1]


@pytest.mark.model
def test_decode_queries_see_less_key_error_than_kivi_on_smollm2(smollm2, real_qkv):
    """The mechanism on real data: queries *after* the prompt (never seen by the subspace) get smaller
    logit errors from SQuat's keys than from KIVI's, summed over the 30 layers."""
    model, _ = smollm2
    errors = []
    for name in ("squat-2bit", "kivi-2bit"):
        pipe = KVPipeline.from_preset(name, compile=False)
        errors.append([held_out_logit_error(q[:, :, 512:], k[:, :, :512], k_hat) for (q, k, _), (_, k_hat, _)
                       in zip(real_qkv, reconstruct_prompt(pipe, model, real_qkv, 512))])
    assert sum(errors[0]) < sum(errors[1]), errors


@pytest.mark.model
@pytest.mark.parametrize("name", ["squat-2bit", "squat-pre-2bit"])
@pytest.mark.eager_first
def test_patched_smollm2_generates_through_the_compressed_cache(smollm2, name):
    model, tokenizer = smollm2
    prompt = documents(tokenizer, 1000, 1)
    with torchkv.patched(model, name), torch.no_grad():
        cache = torchkv.new_cache(model)
        out = model.generate(prompt, **cache_argument(model, cache), max_new_tokens=12, do_sample=False)
        store = cache.layers[0].store
        assert store.n_encoded >= 960 and any(n.endswith(".updates") for n in store.tensors())
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for layer in cache.layers
                    for t in layer.store.tensors().values()}  # each once: the layers share their position ids
        assert cache.nbytes() == sum(storages.values())
        if name == "squat-pre-2bit":
            assert all(layer.store.positions.ids is store.positions.ids for layer in cache.layers)
        logits = model(out[:, -1:], **cache_argument(model, cache)).logits
    reference = model(out).logits[:, -1]
    # a compressed cache at 3 bits per value: the next-token distribution stays close to full precision
    p, p_ref = logits[0, -1].softmax(-1), reference[0].softmax(-1)
    assert 0.5 * (p - p_ref).abs().sum() < 0.35
