import json

import pytest
import torch

import torchkv
import torchkv.transforms as T
from torchkv.pipeline import KVPipeline
from torchkv.testing import rope_tables, tiny_model

PRESETS = [p["name"] for p in torchkv.presets()]


def _kv(b=2, h=3, t=64, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


def test_presets_listing():
    listed = {p["name"]: p for p in torchkv.presets()}
    assert {"fp16", "kivi-2bit", "kivi-4bit", "kivi-8bit"} <= set(listed)
    for entry in listed.values():
        assert entry["description"] and entry["nominal_bits"] > 0
    assert torchkv.DEFAULT_PRESET in listed


def _model_inputs(pipe, k, seed=1):
    """What a preset's transforms read from the model: rotary embedding at positions 0.., prompt queries,
    the layer input."""
    b, h, t, d = k.shape
    inputs = {}
    if "x" in pipe.requires:
        inputs["x"] = torch.randn(b, t, TINY_GQA.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    if "cos" in pipe.requires:
        inputs.update(rope_tables(b, t, d))
    if "queries" in pipe.requires:
        inputs["queries"] = torch.randn(b, 3 * h, t, d, generator=torch.Generator().manual_seed(seed))
    return inputs


#: SVDq's schedules share one chain structure, as do AQUA-KV's and XQuant's presets: a few compile, the rest
#: run eagerly (CI time)
COMPILED_OF_FAMILY = {"svdq-": {"svdq-1.25bit", "svdq-1.25bit-sparse-v4"}, "aquakv-": {"aquakv-2bit"},
                      "xquant-": {"xquant-2bit", "xquant-cl-2bit"}, "frontier-": {"frontier-2.5bit"}}
#: presets that derive parameters from a model's weights (XQuant) are specialized to this GQA model of
#: SmolLM2's KV shape (3 KV heads x 64, X 384 wide)
TINY_GQA = tiny_model(heads=6, kv_heads=3, layers=4, hidden_size=384, head_dim=64)


def _compiled(name: str) -> bool:
    return all(name in chosen for family, chosen in COMPILED_OF_FAMILY.items() if name.startswith(family))


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_roundtrips_and_accounts_real_storage(name):
    pipe = KVPipeline.from_preset(name, compile=_compiled(name)).for_model(TINY_GQA)
    k, v = _kv(t=pipe.chunk * 2)
    inputs = _model_inputs(pipe, k)
    layer = len(pipe.layer_chains)  # the first layer the main chains encode
    prepared = pipe.prepare(k, v, layer=layer, inputs=inputs) if pipe.needs_prepare else {}
    state = pipe.encode_chunk(k, v, layer=layer, prepared=prepared, inputs=inputs)
    kh, vh, *carry = pipe.decode_chunk(state, head_dim=64, layer=layer, prepared=prepared, inputs=inputs)  # + carry
    assert kh.shape == k.shape and vh.shape == v.shape
    assert torch.isfinite(kh).all() and torch.isfinite(vh).all()
    bits = pipe.bits_per_value(kv_heads=3, head_dim=64)
    stored = sum(t.numel() * t.element_size() for n, t in state.items() if n.startswith("k."))
    assert bits.keys == pytest.approx(8 * stored / k.numel())
    assert name in repr(pipe)


@pytest.mark.parametrize(
    "name,bits,error_bound_ratio",
    [("kivi-8bit", 9.0, 0.01), ("kivi-4bit", 5.0, 0.15), ("kivi-2bit", 3.0, 0.7), ("fp16", 16.0, 1e-3)],
)
def test_kivi_bits_and_error_ordering(name, bits, error_bound_ratio):
    pipe = KVPipeline.from_preset(name)
    assert pipe.bits_per_value(3, 64).mean == pytest.approx(bits)
    k, v = _kv(t=128)
    kh, vh = pipe.decode_chunk(pipe.encode_chunk(k, v), head_dim=64)
    assert (kh - k).norm() / k.norm() < error_bound_ratio


def test_overrides_and_their_errors():
    pipe = KVPipeline.from_preset("kivi-2bit", residual=64, sinks=4)
    assert (pipe.residual, pipe.sinks) == (64, 4) and pipe.options["residual"] == 64
    with pytest.raises(ValueError, match=r"no option\(s\) \['bitz'\]; valid options: \['group', 'residual', 'sinks', 'values'\]"):
        KVPipeline.from_preset("kivi-2bit", bitz=3)


@pytest.mark.parametrize(
    "kwargs,error",
    [({"residual": -1}, "residual=-1"), ({"sinks": 1.5}, "sinks=1.5"), ({"chunk": 48}, "chunk=48 must be a positive multiple of 32")],
)
def test_bad_window_settings(kwargs, error):
    with pytest.raises(ValueError, match=error):
        KVPipeline([T.quantize(bits=2, axis="channel", group=32)], [T.quantize("cast")], **kwargs)


def test_bad_tensors():
    pipe = KVPipeline.from_preset("kivi-2bit")
    with pytest.raises(ValueError, match="4-D tensor"):
        pipe.encode_chunk(torch.randn(3, 32, 64), torch.randn(3, 32, 64))
    with pytest.raises(TypeError, match="floating point"):
        pipe.encode_chunk(torch.ones(1, 1, 32, 64, dtype=torch.int64), torch.ones(1, 1, 32, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple of chunk=32"):
        pipe.encode_chunk(*_kv(t=40))
    with pytest.raises(TypeError, match="Transform objects"):
        KVPipeline(["quantize"], [])


def test_save_and_load_roundtrip(tmp_path):
    pipe = KVPipeline.from_preset("kivi-4bit", residual=32)
    pipe.keys.transforms[0].params = {"0.offset": torch.arange(4.0)}
    pipe.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "torchkv_config.json").read_text())
    assert config["version"] == 1 and config["name"] == "kivi-4bit" and config["residual"] == 32
    loaded = KVPipeline.from_pretrained(tmp_path)
    assert repr(loaded) == repr(pipe)
    assert torch.equal(loaded.keys.transforms[0].params["0.offset"], torch.arange(4.0))
    k, v = _kv()
    a, b = pipe.encode_chunk(k, v), loaded.encode_chunk(k, v)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(ValueError, match="has no torchkv_config.json"):
        KVPipeline.from_pretrained(tmp_path / "missing")


def test_compiled_pipeline_equals_eager():
    eager = KVPipeline.from_preset("kivi-2bit")
    compiled = KVPipeline.from_preset("kivi-2bit")
    compiled.compile = True
    k, v = _kv(t=64)
    se, sc = eager.encode_chunk(k, v), compiled.encode_chunk(k, v)
    assert all(torch.equal(se[n], sc[n]) for n in se)
    for a, b in zip(eager.decode_chunk(se, head_dim=64), compiled.decode_chunk(sc, head_dim=64)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
