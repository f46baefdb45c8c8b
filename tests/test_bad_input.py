"""Bad input and faults (issue 22): random preset overrides, wrong dtypes, empty and one-token inputs, NaN/Inf,
corrupted pipeline folders, a cache handed to another model, beam search / crop / reorder in every family.

Everything runs on tiny random models (`torchkv.testing.tiny_model`), eagerly unless a case is about compile."""

import json
import pickle
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchkv
from torchkv import KVPipeline
from torchkv.models import cache_argument
from torchkv.pipeline import CONFIG_FILE, PARAMS_FILE
from torchkv.testing import tiny_model

PRESETS = {p["name"]: p for p in torchkv.presets()}
#: one preset of every family (aquakv is calibrated on the tiny model first, `_pipeline`)
FAMILIES = ["kivi-2bit", "squat-2bit", "subkv-2bit", "svdq-2bit", "xquant-2bit", "xquant-cl-2bit", "aquakv-2bit",
            "frontier-2bit"]
#: overrides that make a tiny model's 100-token prompt reach the compressed store
SMALL_WINDOW = {"kivi-2bit": {"residual": 16}, "squat-2bit": {"residual": 16}, "frontier-2bit": {"residual": 16},
                "aquakv-2bit": {"residual": 16}, "xquant-2bit": {"residual": 16, "group": 32, "token_group": 32},
                "xquant-cl-2bit": {"residual": 16, "group": 32, "token_group": 32, "first_layers": 1},
                "svdq-2bit": {"group": 32}, "subkv-2bit": {}}


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=2)


def _ids(batch: int, tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, n=8, **options):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          **options)


def _fit(pipe: KVPipeline, model) -> KVPipeline:
    """Calibrate on 4 windows of 64 random tokens (what an AQUA-KV preset needs before use)."""
    pipe.fit(model, _ids(4, 64, seed=1), seq_len=64, max_tokens=256, progress=False)
    return pipe


def _pipeline(name: str, model, compile=False, **overrides) -> KVPipeline:
    pipe = KVPipeline.from_preset(name, compile=compile, **{**SMALL_WINDOW.get(name, {}), **overrides})
    return _fit(pipe, model) if pipe.needs_fit else pipe


# -- random preset overrides -------------------------------------------------------------------------------------

_WRONG = st.sampled_from(["x", "", None, 1.5, -2.0, float("nan"), True, False, [1, 2], (3,), {}])
_NUMBERS = st.sampled_from([0, 1, 2, 3, 4, 5, 8, 16, 24, 32, 64, 100, 128, -1, -32])


def _value(default):
    """Values for an option: its default, plausible values of its type, and values of other types."""
    if isinstance(default, bool):
        typed = st.booleans()
    elif isinstance(default, int):
        typed = _NUMBERS
    elif isinstance(default, float):
        typed = st.sampled_from([0.0, 1e-6, 1e-3, 0.5, 10.0, -1.0, float("inf")])
    elif isinstance(default, str):
        typed = st.sampled_from(["auto", "head", "token", "fp", "mha", "gqa", "both", "keys", "none", "uniform",
                                 "higgs", "float16", "bfloat16", "float8_e5m2", "float32", "quantized", "bogus"])
    elif isinstance(default, tuple):
        typed = st.lists(st.sampled_from([0, 1, 2, 3, 4, 8, 16]), min_size=0, max_size=10).map(tuple)
    else:  # None default (squat block)
        typed = st.one_of(st.none(), _NUMBERS)
    return st.one_of(st.just(default), typed, typed, _WRONG)


@st.composite
def _overrides(draw):
    name = draw(st.sampled_from(sorted(PRESETS)))
    options = PRESETS[name]["options"]
    chosen = draw(st.lists(st.sampled_from(sorted(options)), unique=True, max_size=3)) if options else []
    return name, {option: draw(_value(options[option])) for option in chosen}


@given(case=_overrides(), prompt=st.integers(1, 200))
def test_random_preset_overrides_give_a_working_pipeline_or_a_value_error_naming_the_option(model, case, prompt):
    """A preset with any overrides either builds, patches and generates, or raises ValueError naming the option;
    no other exception type, at build, patch or generation time."""
    name, overrides = case
    try:
        pipe = KVPipeline.from_preset(name, compile=False, **overrides)
    except ValueError as err:
        assert overrides and any(option in str(err) for option in overrides), str(err)
        return
    ids = _ids(1, prompt)
    try:
        if pipe.needs_fit:
            _fit(pipe, model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torchkv.patched(model, pipe):
                out = _generate(model, ids, n=6)
    except ValueError as err:  # refused before generating: names an option (or says to calibrate)
        assert any(option in str(err) for option in [*overrides, "calibrat", "options"]), str(err)
        return
    assert out.shape == (1, prompt + 6)
    assert ((out >= 0) & (out < 128)).all()


@pytest.mark.parametrize(("name", "overrides", "option"), [
    ("kivi-2bit", {"group": 1.5}, "group"),
    ("kivi-2bit", {"values": True}, "values"),
    ("squat-2bit", {"lam": "x"}, "lam"),
    ("subkv-2bit", {"group": 0}, "group"),
    ("svdq-2bit", {"schedule": 3}, "schedule"),
    ("frontier-2bit", {"wide_layers": None}, "wide_layers"),
    ("xquant-2bit", {"outliers": 1.5}, "outliers"),  # was a TypeError in the middle of generate
])
def test_an_override_of_the_wrong_type_is_a_value_error_naming_it(name, overrides, option):
    with pytest.raises(ValueError, match=rf"preset '{name}'.*{option}="):
        KVPipeline.from_preset(name, **overrides)


# -- dtypes ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["kivi-2bit", "subkv-2bit", "aquakv-2bit-nopred"])
def test_encode_refuses_integer_inputs_and_encodes_float64_as_float32(name):
    pipe = KVPipeline.from_preset(name, compile=False)
    k = torch.randn(1, 2, pipe.chunk, 32, generator=torch.Generator().manual_seed(0))
    inputs = {"cos": torch.ones(1, pipe.chunk, 32), "sin": torch.zeros(1, pipe.chunk, 32)} \
        if {"cos", "sin"} & pipe.requires else None
    with pytest.raises(TypeError, match="k must be floating point.*int64"):
        pipe.encode_chunk((k * 10).long(), k, inputs=inputs)
    wide = pipe.decode_chunk(pipe.encode_chunk(k.double(), k.double(), inputs=inputs), head_dim=32, inputs=inputs)
    single = pipe.decode_chunk(pipe.encode_chunk(k, k, inputs=inputs), head_dim=32, inputs=inputs)
    for a, b in zip(wide, single):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_pre_rope_keys_without_rotary_tables_are_a_clear_error():
    """Was a KeyError 'cos' from inside the transform."""
    pipe = KVPipeline.from_preset("svdq-2bit", compile=False)
    k = torch.randn(1, 2, 64, 32)
    with pytest.raises(ValueError, match="rotate.pre_rope needs the rotary tables.*inputs="):
        pipe.prepare(k, k)


def test_a_float16_model_with_a_float32_calibrated_folder(tmp_path):
    """AQUA-KV calibrated on a float32 model, saved, loaded and patched into the same model in float16 (the
    fingerprint does not hold the dtype): it must run, compress in float16 and stay finite."""
    fp32 = tiny_model(layers=3)
    pipe = _pipeline("aquakv-2bit", fp32)
    pipe.save_pretrained(tmp_path)
    half = tiny_model(layers=3, dtype=torch.float16)
    ids = _ids(1, 100)
    loaded = KVPipeline.from_pretrained(tmp_path)
    loaded.compile = False  # about dtypes, not kernels
    with torchkv.patched(half, loaded):
        out = _generate(half, ids, n=8)
        cache = torchkv.new_cache(half)
        with torch.no_grad():
            logits = half(ids, **torchkv.models.cache_argument(half, cache)).logits
    assert out.shape == (1, 108)
    assert torch.isfinite(logits).all()
    assert cache.layers[1].store.n_encoded > 0 and cache.layers[1].store.dtype == torch.float16


# -- empty, one-token, max_new_tokens=0 -----------------------------------------------------------------------------

def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as err:  # noqa: BLE001  (comparing what two runs raise)
        return type(err), str(err)


def test_an_empty_prompt_fails_as_the_unpatched_model_does_and_leaves_the_cache_usable(model):
    """0 tokens: transformers itself refuses (it cannot reshape an empty projection); a patched model must raise
    the same, not something from torchkv, and the cache must take a real prompt afterwards."""
    empty = _ids(1, 0)
    expected = _outcome(lambda: model(empty, use_cache=True))
    assert expected[0] != "ok"
    with torchkv.patched(model, "kivi-2bit"):
        cache = torchkv.new_cache(model)
        got = _outcome(lambda: model(empty, **torchkv.models.cache_argument(model, cache)))
        assert got == expected
        model(_ids(1, 5), **torchkv.models.cache_argument(model, cache))
    assert cache.get_seq_length() == 5


def test_encode_chunk_of_zero_tokens(model):
    pipe = KVPipeline.from_preset("kivi-2bit", compile=False)
    k = torch.randn(1, 2, 0, 32)
    outcome = _outcome(lambda: pipe.decode_chunk(pipe.encode_chunk(k, k), head_dim=32))
    assert outcome[0] in ("ok", ValueError), outcome
    if outcome[0] == "ok":
        assert all(t.shape == (1, 2, 0, 32) for t in outcome[1])


@pytest.mark.parametrize("name", FAMILIES)
def test_a_one_token_prompt_generates_like_the_unpatched_model(model, name):
    """One prompt token and 8 new ones stay in the full-precision window: exactly the unpatched tokens."""
    pipe = _pipeline(name, model)
    ids = _ids(1, 1)
    expected = _generate(model, ids)
    with torchkv.patched(model, pipe):
        got = _generate(model, ids)
    assert torch.equal(got, expected)


def test_max_new_tokens_zero_is_refused_as_transformers_refuses_it(model):
    ids = _ids(1, 20)
    expected = _outcome(lambda: _generate(model, ids, n=0))
    with torchkv.patched(model, "kivi-2bit"):
        got = _outcome(lambda: _generate(model, ids, n=0))
        after = _generate(model, ids, n=2)  # the patched model still works
    assert got == expected and after.shape == (1, 22)


# -- NaN / Inf ------------------------------------------------------------------------------------------------------

def test_nan_and_inf_keys_stay_inside_their_quantization_groups():
    """Compiled encode/decode of chunks with a NaN in one and an Inf in another: no error, and every chunk without
    a non-finite value decodes exactly as it does alone (kivi: groups never span chunks)."""
    pipe = KVPipeline.from_preset("kivi-2bit", compile=True)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 128, 32, generator=g), torch.randn(1, 2, 128, 32, generator=g)
    k[0, 0, 5, 3] = float("nan")
    v[0, 1, 70, 0] = float("inf")
    dk, dv = pipe.decode_chunk(pipe.encode_chunk(k, v), head_dim=32)
    ck, cv = pipe.decode_chunk(pipe.encode_chunk(k[:, :, 32:64], v[:, :, 32:64]), head_dim=32)
    torch.testing.assert_close(dk[:, :, 32:64], ck, rtol=0, atol=0)
    torch.testing.assert_close(dv[:, :, 32:64], cv, rtol=0, atol=0)
    assert torch.isfinite(dk[:, :, 32:]).all() and torch.isfinite(dv[:, :, 96:]).all()
    assert not torch.isfinite(dk[0, 0, :32]).all()


@pytest.mark.parametrize("name", ["kivi-2bit", "frontier-2bit", *(pytest.param(n, marks=pytest.mark.slow)
                                                                   for n in ("svdq-2bit", "squat-2bit", "xquant-2bit"))])
def test_nan_in_the_hidden_states_is_contained_like_the_unpatched_model(model, name):
    """A NaN input embedding at position 60 of 100 (compiled pipeline, prompt compressed): no exception, and the
    logits are non-finite exactly where the unpatched model's are (transformers' own attention spreads a NaN value
    to every row, 0·NaN), in the prompt and at the next decode step."""
    ids = _ids(1, 101)
    embeds = model.get_input_embeddings()(ids).detach()
    embeds[0, 60] = float("nan")
    with torch.no_grad():
        reference = model(inputs_embeds=embeds, use_cache=True)
        step = model(ids[:, 100:], **cache_argument(model, reference.past_key_values)).logits
        pipe = _pipeline(name, model, compile=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torchkv.patched(model, pipe):
                cache = torchkv.new_cache(model)
                arg = torchkv.models.cache_argument(model, cache)
                got = model(inputs_embeds=embeds[:, :100], **arg).logits
                got_step = model(ids[:, 100:], **arg).logits
    assert cache.layers[0].store.n_encoded > 0
    assert torch.equal(torch.isfinite(got), torch.isfinite(reference.logits[:, :100]))
    assert torch.equal(torch.isfinite(got_step), torch.isfinite(step))


# -- corrupted pipeline folders -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A calibrated AQUA-KV pipeline (config + safetensors parameters) saved by `save_pretrained`."""
    model = tiny_model(layers=2)
    path = tmp_path_factory.mktemp("aquakv")
    _pipeline("aquakv-2bit", model).save_pretrained(path)
    return path, model


def test_save_pretrained_writes_safetensors_and_loading_never_unpickles(saved, monkeypatch, tmp_path):
    path, model = saved
    raw = (path / PARAMS_FILE).read_bytes()
    header = int.from_bytes(raw[:8], "little")  # safetensors: u64 header length, then a JSON header
    assert json.loads(raw[8 : 8 + header])["__metadata__"]["aliases"] is not None
    assert not raw.startswith(b"\x80") and b"PK\x03\x04" not in raw[:4]  # no pickle protocol, no torch zip

    def refuse(*args, **kwargs):
        raise AssertionError("loading a pipeline folder must not unpickle")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    pipe = KVPipeline.from_pretrained(path)
    pipe.compile = False
    with torchkv.patched(model, pipe):
        assert _generate(model, _ids(1, 80), n=2).shape == (1, 82)


def _corrupt(path, tmp_path, what: str):
    import shutil

    target = tmp_path / "pipe"
    shutil.copytree(path, target)
    config, params = target / CONFIG_FILE, target / PARAMS_FILE
    if what == "no config":
        config.unlink()
    elif what == "truncated config":
        config.write_text(config.read_text()[:100])
    elif what == "garbled config":
        config.write_bytes(b"\xff\xfe garbage \x00" * 10)
    elif what == "config without keys":
        spec = json.loads(config.read_text())
        del spec["keys"]
        config.write_text(json.dumps(spec))
    elif what == "config with an unknown transform":
        spec = json.loads(config.read_text())
        spec["keys"][-1]["name"] = "no_such_transform"
        config.write_text(json.dumps(spec))
    elif what == "config not an object":
        config.write_text("[1, 2, 3]")
    elif what == "truncated params":
        params.write_bytes(params.read_bytes()[:200])
    elif what == "garbled params":
        params.write_bytes(b"\x00" * 8 + b"not a safetensors file" * 20)
    elif what == "pickle as params":
        torch.save({"k.1.w": torch.zeros(3)}, params)
    return target


@pytest.mark.parametrize("what", ["no config", "truncated config", "garbled config", "config without keys",
                                  "config with an unknown transform", "config not an object", "truncated params",
                                  "garbled params", "pickle as params"])
def test_a_corrupted_pipeline_folder_is_a_clear_value_error(saved, tmp_path, what):
    path, _ = saved
    broken = _corrupt(path, tmp_path, what)
    bad_file = PARAMS_FILE if "params" in what else CONFIG_FILE
    with pytest.raises(ValueError, match=bad_file if what != "config with an unknown transform" else "no_such"):
        KVPipeline.from_pretrained(broken)


def test_a_folder_without_its_params_file_is_refused_at_patch(saved, tmp_path):
    path, model = saved
    broken = _corrupt(path, tmp_path, "none")
    (broken / PARAMS_FILE).unlink()
    pipe = KVPipeline.from_pretrained(broken)
    with pytest.raises(ValueError, match="no fitted parameters|uncalibrated"):
        torchkv.patch(model, pipe)


# -- a cache handed to another model --------------------------------------------------------------------------------

def test_a_cache_made_for_one_model_is_refused_by_another():
    a, b = tiny_model(layers=2, seed=0), tiny_model(layers=2, seed=1)
    ids = _ids(1, 40)
    with torchkv.patched(a, "kivi-2bit"), torchkv.patched(b, "kivi-2bit"):
        cache = torchkv.new_cache(a)
        a(ids, **torchkv.models.cache_argument(a, cache))
        with pytest.raises(ValueError, match="another model"):
            b(ids[:, :1], **torchkv.models.cache_argument(b, cache))
        with pytest.raises(ValueError, match="another model"):
            b.generate(ids, attention_mask=torch.ones_like(ids), **cache_argument(b, torchkv.new_cache(a)),
                       max_new_tokens=2, do_sample=False)


def test_a_cache_of_another_depth_or_an_unpatched_model_is_refused():
    a, deeper = tiny_model(layers=2), tiny_model(layers=3)
    ids = _ids(1, 40)
    with torchkv.patched(a, "kivi-2bit"):
        cache = torchkv.new_cache(a)
        with torchkv.patched(deeper, "kivi-2bit"), pytest.raises(ValueError, match="another model"):
            deeper(ids, **torchkv.models.cache_argument(deeper, cache))
        plain = tiny_model(layers=2, seed=2)  # never patched: its attention cannot read a torchkv cache
        with pytest.raises((ValueError, AttributeError), match="torchkv"):
            plain(ids, **torchkv.models.cache_argument(plain, torchkv.new_cache(a)))


# -- beam search, crop, reorder in every family ----------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_beam_search_crop_and_reorder(model, name):
    pipe = _pipeline(name, model)
    ids = _ids(2, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torchkv.patched(model, pipe):
            out = _generate(model, ids[:1], n=6, num_beams=2)
            assert out.shape == (1, 106)
            cache = torchkv.new_cache(model)
            with torch.no_grad():
                model(ids, **torchkv.models.cache_argument(model, cache))
            assert cache.layers[0].store.n_encoded > 0, "the prompt must reach the compressed store"

            def histories():
                return [layer.store.history() for layer in cache.layers]  # layer order (cross-layer pipelines)

            before = histories()
            cache.reorder_cache(torch.tensor([1, 0]))
            for (k, v), (k0, v0) in zip(histories(), before):
                assert torch.equal(k, k0.flip(0)) and torch.equal(v, v0.flip(0))
            cache.reorder_cache(torch.tensor([1, 0]))
            n = 3
            cache.crop(-n)
            assert cache.get_seq_length() == 100 - n
            for (k, v), (k0, v0) in zip(histories(), before):
                torch.testing.assert_close(k, k0[:, :, : 100 - n], rtol=0, atol=0)
                torch.testing.assert_close(v, v0[:, :, : 100 - n], rtol=0, atol=0)
            with torch.no_grad():  # and the cropped cache takes the next tokens
                logits = model(ids[:, 100 - n :], **torchkv.models.cache_argument(model, cache)).logits
    assert cache.get_seq_length() == 100 and torch.isfinite(logits).all()


# -- padded batches --------------------------------------------------------------------------------------------------

def test_padding_a_cache_cannot_hold_row_by_row_is_refused_with_advice_to_left_pad(model):
    ids = _ids(2, 60)
    right = torch.ones_like(ids)
    right[1, 50:] = 0
    hole = torch.ones_like(ids)
    hole[0, 20:25] = 0
    empty = torch.ones_like(ids)
    empty[1] = 0
    with torchkv.patched(model, KVPipeline.from_preset("kivi-2bit", compile=False)), torch.no_grad():
        for mask, message in ((right, "right padding"), (hole, "padding between tokens"), (empty, "all padding")):
            with pytest.raises(ValueError, match=message):
                model(ids, attention_mask=mask, **cache_argument(model, torchkv.new_cache(model)))
        with pytest.raises(ValueError, match="left"):
            model.generate(ids, attention_mask=right, max_new_tokens=2, do_sample=False, pad_token_id=0)
        # left padding is taken
        left = torch.ones_like(ids)
        left[1, :13] = 0
        model(ids, attention_mask=left, **cache_argument(model, torchkv.new_cache(model)))


@pytest.mark.parametrize("name", ["kivi-2bit", "frontier-2bit"])
def test_beam_search_over_a_left_padded_batch_gives_each_row_its_beams_alone(model, name):
    """Row groups follow beam search's reordering and repeated rows: each row's beams are its beams alone."""
    pipe = KVPipeline.from_preset(name, compile=False, **SMALL_WINDOW[name])
    rows = [_ids(1, 100, seed=1)[0], _ids(1, 71, seed=2)[0]]
    ids = torch.zeros(2, 100, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, 100 - len(r):], mask[i, 100 - len(r):] = r, 1
    with torchkv.patched(model, pipe):
        both = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, num_beams=3,
                              num_return_sequences=2)
        for i, r in enumerate(rows):
            alone = _generate(model, r[None], n=6, num_beams=3, num_return_sequences=2)
            assert torch.equal(both[2 * i : 2 * i + 2, 100:], alone[:, len(r):]), (name, i)
