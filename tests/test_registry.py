from dataclasses import dataclass

import pytest
import torch

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
