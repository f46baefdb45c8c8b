"""`benchmarks/override_layers.py`: a saved folder copied with some layers' widths or metadata type changed."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchkv.pipeline import KVPipeline
from torchkv.testing import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = load_script(ROOT / "benchmarks/override_layers.py")
#: Gemma 3's recommended 2.5-bit folder: 18 layers, one KV head, per-layer chains with 2- to 4-bit keys
GEMMA = ROOT / "benchmarks/results/gemma3/tuned/frontier-2bit@2.5_mixed_either_centre_full_layers_unbiased_values"
SOURCE = KVPipeline.from_pretrained(GEMMA)


def _quantizer(chain):
    return next(t for t in chain.transforms if t.kind == "quantize")


@settings(max_examples=12, deadline=None)
@given(layers=st.lists(st.integers(0, 17), min_size=1, max_size=4, unique=True),
       key_bits=st.sampled_from([None, 2, 2.5, 3, 4]), value_bits=st.sampled_from([None, 1, 2, 4, 8]),
       meta_dtype=st.sampled_from([None, "float16"]))
def test_only_the_chosen_layers_change_and_only_as_asked(layers, key_bits, value_bits, meta_dtype):
    """The chosen layers store each side at the width asked (the other side's width unchanged), every quantizer's
    metadata in the type asked; every other layer keeps its chains; the stored bits move the way the widths do."""
    if key_bits is None and value_bits is None and meta_dtype is None:
        with pytest.raises(ValueError, match="nothing to override"):
            SCRIPT.override(SOURCE, layers)
        return
    pipe = SCRIPT.override(SOURCE, layers, key_bits, value_bits, meta_dtype)
    assert pipe.options["overridden"]["layers"] == layers and pipe.tuned_for == SOURCE.tuned_for
    for layer in range(18):
        new, old = pipe.for_layer(layer), SOURCE.for_layer(layer)
        if layer not in layers:
            assert (new.keys.spec(), new.values.spec()) == (old.keys.spec(), old.values.spec())
            continue
        stored, was_stored = new.bits_per_value(1, 256), old.bits_per_value(1, 256)
        for side, bits in (("keys", key_bits), ("values", value_bits)):
            q, was = _quantizer(getattr(new, side)), _quantizer(getattr(old, side))
            assert q.config.bits == (was.config.bits if bits is None else bits)
            meta = q.config.scale_dtype if side == "keys" else q.config.meta_dtype
            was_meta = was.config.scale_dtype if side == "keys" else was.config.meta_dtype
            assert meta == (meta_dtype or was_meta)
            if bits is None or bits >= was.config.bits:  # float16 metadata is wider than float8
                assert getattr(stored, side) >= getattr(was_stored, side)
            elif meta_dtype is None:
                assert getattr(stored, side) < getattr(was_stored, side)


def test_the_folder_copy_loads_keeps_its_tuning_report_and_bad_requests_are_refused(tmp_path):
    """The written folder loads to the same chains and keeps `tune.json` (so it is refused on another model); layers
    the model lacks, a per-head folder, a width the chain cannot take and a calibrated folder are refused with what
    to do."""
    pipe = SCRIPT.override_folder(GEMMA, tmp_path / "out", [5, 11, 17], key_bits=4)
    copy = KVPipeline.from_pretrained(tmp_path / "out")
    assert [copy.for_layer(i).keys.spec() for i in range(18)] == [pipe.for_layer(i).keys.spec() for i in range(18)]
    assert (tmp_path / "out/tune.json").read_bytes() == (GEMMA / "tune.json").read_bytes()
    with pytest.raises(ValueError, match=r"layers \[18\] are not layers of the model .* \(18 layers\)"):
        SCRIPT.override(SOURCE, [0, 18], key_bits=4)
    per_head = KVPipeline.from_pretrained(ROOT / "benchmarks/results/domains/tuned/frontier-2bit@2.5_mixed_per_head")
    with pytest.raises(ValueError, match="groups its KV heads"):
        SCRIPT.override(per_head, [0], key_bits=4)
    with pytest.raises(ValueError, match="layer 5's values .* cannot be stored at 2.5 bits"):
        SCRIPT.override(SOURCE, [5], value_bits=2.5)
    calibrated = KVPipeline.from_pretrained(ROOT / "benchmarks/results/domains/calibrated/aquakv-2bit_wiki")
    with pytest.raises(ValueError, match="has fitted parameters"):
        SCRIPT.override(calibrated, [0], key_bits=4)


def test_without_drops_a_transform_from_the_chosen_layers_only():
    """`--without balance`: the chosen layers' keys lose the query balance and keep the rest of their chain (widths
    included); other layers keep it; a name the layer lacks is refused."""
    pipe = SCRIPT.override(SOURCE, [5, 17], without="balance")
    for layer in range(18):
        names, was = ([t.name for t in p.for_layer(layer).keys.transforms] for p in (pipe, SOURCE))
        assert "balance" in was
        assert names == ([n for n in was if n != "balance"] if layer in (5, 17) else was)
        assert pipe.for_layer(layer).values.spec() == SOURCE.for_layer(layer).values.spec()
    with pytest.raises(ValueError, match="layer 5 has no transform named 'rotate_keys' to drop"):
        SCRIPT.override(SOURCE, [5], without="rotate_keys")


def test_a_side_taken_from_a_preset_replaces_that_side_in_the_chosen_layers_only():
    """`--keys-from kivi-4bit`: the chosen layers' keys are KIVI's per-channel chain (their stored bits with it), the
    values and the other layers unchanged; widths given too apply on top; a side that predicts, needs calibration or
    is rebuilt from the layer's input, and token groups that do not divide the folder's chunk, are refused."""
    kivi = KVPipeline.from_preset("kivi-4bit")
    pipe = SCRIPT.override(SOURCE, [5, 11], keys_from="kivi-4bit", value_bits=4)
    assert pipe.options["overridden"] == {"layers": [5, 11], "value_bits": 4, "keys_from": "kivi-4bit"}
    for layer in range(18):
        new, old = pipe.for_layer(layer), SOURCE.for_layer(layer)
        if layer in (5, 11):
            assert new.keys.spec() == kivi.keys.spec()
            assert new.bits_per_value(1, 256).keys == kivi.bits_per_value(1, 256).keys == 5.0
            assert _quantizer(new.values).config.bits == 4 and _quantizer(new.values).name == "uniform"
        else:
            assert (new.keys.spec(), new.values.spec()) == (old.keys.spec(), old.values.spec())
    values = SCRIPT.override(SOURCE, [17], values_from="kivi-4bit:group=128").for_layer(17).values
    assert values.spec() == KVPipeline.from_preset("kivi-4bit:group=128").values.spec()
    with pytest.raises(ValueError, match="groups of 128 tokens, which do not divide the folder's 32-token chunks"):
        SCRIPT.override(SOURCE, [5], keys_from="kivi-4bit:group=128")
    with pytest.raises(ValueError, match=r"hold \[.*a predictor.*take a side that is one chain fitted per sequence"):
        SCRIPT.override(SOURCE, [5], keys_from="aquakv-2bit")
    with pytest.raises(ValueError, match=r"hold \[project\.weights.*take a side that is one chain fitted per sequence"):
        SCRIPT.override(SOURCE, [5], values_from="xquant-2bit")
