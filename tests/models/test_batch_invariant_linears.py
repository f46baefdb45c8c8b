"""Linear layers in fixed blocks of rows (`torchkv.patch(..., batch_invariant=True)`): a row's output is the same bits
wherever it sits and however many rows share the call, and the option comes off with `unpatch`."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import torchkv
from torchkv.models.batch_invariant import batch_invariant_linears, block_linear, make_linears_batch_invariant
from torchkv.testing import tiny_model


@given(before=st.integers(0, 40), after=st.integers(0, 40), features=st.sampled_from([(64, 96), (96, 32), (48, 48)]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_a_row_is_computed_the_same_wherever_it_sits(before, after, features, bias, seed):
    """Row r of a call with `before` rows ahead of it and `after` behind equals r computed alone, bit for bit, and
    both equal `F.linear` up to rounding. (Plain `F.linear` gives such a row up to 1e-5 away from itself alone on
    this project's CPUs: its kernel depends on the row count.)"""
    g = torch.Generator().manual_seed(seed)
    k, n = features
    weight, x = torch.randn(n, k, generator=g), torch.randn(before + 1 + after, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    alone = block_linear(x[before : before + 1], weight, b)
    assert torch.equal(block_linear(x, weight, b)[before], alone[0])
    torch.testing.assert_close(alone, F.linear(x[before : before + 1], weight, b))


def test_leading_dimensions_are_kept():
    x, weight = torch.randn(3, 5, 7, 16), torch.randn(24, 16)
    torch.testing.assert_close(block_linear(x, weight), F.linear(x, weight))


def test_patch_and_the_context_block_every_linear_layer_and_restore_them():
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        linears = [m for m in model.modules() if type(m) is nn.Linear]
        with torchkv.patched(model, "kivi-4bit", batch_invariant=True):
            assert all("forward" in vars(m) for m in linears)
            blocked = model(ids, use_cache=False).logits
        assert not any("forward" in vars(m) for m in linears)
        torch.testing.assert_close(blocked, plain)
        with batch_invariant_linears(model):  # an unpatched model (the `dynamic` rows of the benchmarks)
            assert all("forward" in vars(m) for m in linears)
        assert not any("forward" in vars(m) for m in linears)


def test_models_it_cannot_block_are_refused():
    with pytest.raises(ValueError, match="no torch.nn.Linear"):
        make_linears_batch_invariant(nn.Sequential(nn.ReLU()))
    hooked = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    hooked[1].forward = lambda x: x  # as accelerate's offloading hooks do
    with pytest.raises(ValueError, match="'1'.*already replaced"):
        make_linears_batch_invariant(hooked)
    assert "forward" not in vars(hooked[0])  # nothing changed


def test_a_refused_patch_leaves_the_model_as_it_was():
    model = tiny_model("llama")
    model.lm_head.forward = lambda x: x  # as accelerate's offloading hooks do
    previous = model.config._attn_implementation
    with pytest.raises(ValueError, match="already replaced"):
        torchkv.patch(model, "kivi-4bit", batch_invariant=True)
    assert model.config._attn_implementation == previous and torchkv.pipeline_of(model) is None
