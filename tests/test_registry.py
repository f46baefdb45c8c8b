from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchkv
import torchkv.transforms as T
from torchkv import registry
from torchkv.transforms import Transform, TransformConfig


@dataclass(frozen=True, kw_only=True)
class SignConfig(TransformConfig):
    scale: float = 1.0


@torchkv.register_transform("quantize", "test_sign")
class SignQuantize(Transform):
    """1-bit sign codes times a per-token mean magnitude (a user-defined transform)."""

    Config = SignConfig
    code_bits = 1

    def encode(self, x, ctx):
        return (x > 0).to(torch.uint8), {"mag": x.abs().mean(-1, keepdim=True).half()}

    def decode(self, y, state, ctx):
        return (y.float() * 2 - 1) * state["mag"].float()


def test_user_transform_composes_into_a_pipeline():
    pipe = torchkv.KVPipeline([T.quantize("test_sign"), T.pack()], [T.quantize(bits=4, group=32), T.pack()], residual=0)
    assert pipe.keys.transforms[1].config.bits == 1
    k = torch.randn(1, 2, 32, 64)
    state = pipe.encode_chunk(k, k)
    assert state["k.out"].shape == (1, 2, 32, 8)
    kh, _ = pipe.decode_chunk(state, head_dim=64)
    assert torch.equal(kh.sign(), k.sign())
    assert pipe.bits_per_value(2, 64).keys == pytest.approx(1 + 16 / 64)


def test_duplicate_and_unknown_names():
    with pytest.raises(ValueError, match="already registered"):
        torchkv.register_transform("quantize", "test_sign")(SignQuantize)
    with pytest.raises(ValueError, match="unknown transform kind 'squash'"):
        torchkv.register_transform("squash", "x")
    with pytest.raises(ValueError, match=r"unknown quantize transform 'unifrom' \(did you mean 'uniform'\?\)"):
        T.quantize("unifrom", bits=2)


def test_unknown_preset_lists_presets_and_closest_match():
    with pytest.raises(ValueError) as err:
        registry.preset("kivi2bit")
    message = str(err.value)
    assert "did you mean 'kivi-2bit'" in message and "kivi-4bit" in message and "torchkv.presets()" in message


# -- one spelling of a preset with overrides ----------------------------------------------------------------------


@given(residual=st.integers(0, 512), group=st.sampled_from([16, 32, 64]), quoted=st.booleans())
def test_preset_strings_parse_to_the_keyword_overrides(residual, group, quoted):
    from torchkv.pipeline import parse_preset

    text = f"kivi-2bit:residual={residual}:group={group}"
    assert parse_preset(text) == ("kivi-2bit", {"residual": residual, "group": group})
    written = torchkv.KVPipeline.from_preset(text)
    keyword = torchkv.KVPipeline.from_preset("kivi-2bit", residual=residual, group=group)
    assert written.config() == keyword.config() and written.name == "kivi-2bit"
    value = "'fp'" if quoted else "fp"  # strings with or without quotes
    assert parse_preset(f"svdq-2bit:generated={value}")[1] == {"generated": "fp"}


def test_patch_eval_rows_and_folders_take_the_same_strings(tmp_path):
    from torchkv.eval.rows import method
    from torchkv.testing import tiny_model

    text = "kivi-2bit:residual=32:group=16"
    model = tiny_model()
    with torchkv.patched(model, text):
        assert torchkv.pipeline_of(model).config() == torchkv.KVPipeline.from_preset(text).config()
    assert method(text).pipeline.config() == torchkv.KVPipeline.from_preset(text).config()
    assert method(f"compiled:{text}").pipeline.residual == 32
    folder = tmp_path / "saved"
    torchkv.KVPipeline.from_preset(text).save_pretrained(folder)
    with torchkv.patched(model, str(folder)):
        assert torchkv.pipeline_of(model).residual == 32
    assert method(str(folder)).pipeline.residual == 32


def test_bad_preset_strings_say_how_to_write_them():
    with pytest.raises(ValueError, match="must be written key=value, e.g. kivi-2bit:residual=32"):
        torchkv.KVPipeline.from_preset("kivi-2bit:residual")
    with pytest.raises(ValueError, match="'residual' is given twice"):
        torchkv.KVPipeline.from_preset("kivi-2bit:residual=8:residual=16")
    with pytest.raises(ValueError, match=r"given both after a colon and as keywords"):
        torchkv.KVPipeline.from_preset("kivi-2bit:residual=8", residual=16)
    with pytest.raises(ValueError, match=r"has no option\(s\) \['resid'\]; valid options: .*'residual'"):
        torchkv.KVPipeline.from_preset("kivi-2bit:resid=8")
    with pytest.raises(ValueError, match="unknown preset 'kivi-3bit'"):
        torchkv.KVPipeline.from_preset("kivi-3bit:residual=8")


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_preset_with_overrides_is_spelled_so_that_it_builds_again(data):
    """`spelling` gives a preset's name and the options that differ from its defaults (a tuned folder's report
    keeps it, and `benchmarks/reallocate.py` builds the candidates from it): read back, it builds the same chains."""
    from torchkv.pipeline.presets import spelling

    name = data.draw(st.sampled_from(registry.preset_names()))
    defaults = registry.preset(name).options()
    flags = sorted(k for k, v in defaults.items() if isinstance(v, bool))
    flipped = data.draw(st.lists(st.sampled_from(flags), unique=True)) if flags else []
    try:
        pipe = torchkv.KVPipeline.from_preset(name, **{k: not defaults[k] for k in flipped})
    except ValueError:  # options that exclude each other
        return
    spelled = spelling(pipe)
    assert spelled.split(":")[0] == name and len(spelled.split(":")) == 1 + len(flipped)
    again = torchkv.KVPipeline.from_preset(spelled)
    assert again.options == pipe.options and again.keys.spec() == pipe.keys.spec()
    assert again.values.spec() == pipe.values.spec()
