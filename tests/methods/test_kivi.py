"""KIVI on real keys and values: SmolLM2 on held-out Wikipedia text."""

import pytest
import torch

from torchkv.corpora import documents
from torchkv.pipeline import KVPipeline
from torchkv.testing import capture_kv, sqnr

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def real_kv(smollm2):
    model, tokenizer = smollm2
    return capture_kv(model, documents(tokenizer, 512, 1))


def _sqnr(pipe, real_kv):
    ks, vs = [], []
    for k, v in real_kv:
        kh, vh = pipe.decode_chunk(pipe.encode_chunk(k, v), head_dim=k.shape[-1])
        ks.append(sqnr(k, kh))
        vs.append(sqnr(v, vh))
    return min(ks), min(vs)


def test_error_ordering_on_real_kv(real_kv):
    """More bits, less error, for keys and values of every one of the 30 layers (worst layer reported)."""
    floors = {"kivi-8bit": (45, 40), "kivi-4bit": (23, 17), "kivi-2bit": (10, 4)}
    measured = {name: _sqnr(KVPipeline.from_preset(name, compile=False), real_kv) for name in floors}
    for name, (k_floor, v_floor) in floors.items():
        assert measured[name][0] > k_floor and measured[name][1] > v_floor, (name, measured[name])
    assert measured["kivi-8bit"] > measured["kivi-4bit"] > measured["kivi-2bit"]


def test_per_channel_keys_beat_per_token_keys(real_kv):
    """KIVI's observation: keys have outlier channels, so per-channel grouping quantizes them better."""
    import torchkv.transforms as T

    per_token = KVPipeline([T.quantize(bits=2, axis="token", group=32)], [T.quantize("cast")], compile=False)
    per_channel = KVPipeline([T.quantize(bits=2, axis="channel", group=32)], [T.quantize("cast")], compile=False)
    assert _sqnr(per_channel, real_kv)[0] > _sqnr(per_token, real_kv)[0]


def test_measured_bits(real_kv):
    k, v = real_kv[0]
    pipe = KVPipeline.from_preset("kivi-2bit")
    state = pipe.encode_chunk(k, v)
    stored = sum(t.numel() * t.element_size() for t in state.values())
    assert 8 * stored / (2 * k.numel()) == pytest.approx(3.0)
    assert pipe.bits_per_value(3, 64).mean == pytest.approx(3.0)
    assert torch.equal(state["k.out"], KVPipeline.from_preset("kivi-2bit").encode_chunk(k, v)["k.out"])
