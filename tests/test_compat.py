"""Workarounds in `torchkv._compat` for the torch and transformers versions we run on."""

import torch

import torchkv  # noqa: F401  (importing torchkv applies the workarounds)


class _Flag:
    def __init__(self):
        self.value = None


def test_an_attribute_written_around_a_cond_keeps_its_last_value():
    """An object written before a `torch.cond` and again after it (a context variable set around a layer whose window
    flush is a cond): the compiled code must leave the last value, as eager code does (torch 2.13 left the first)."""
    flag, other = _Flag(), _Flag()

    def step(x, n):
        flag.value = "set"
        y = torch.cond(n > 3, lambda x: x.sin(), lambda x: x.cos(), (x,))
        flag.value = None
        other.value = "after"
        return y

    x, n = torch.randn(4), torch.tensor(5)
    torch.testing.assert_close(torch.compile(step, fullgraph=True, backend="eager")(x, n), x.sin())
    assert flag.value is None and other.value == "after"
