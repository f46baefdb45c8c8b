"""Unbiased scales (`unbiased=True` of `quantize.uniform` and `quantize.higgs`): each rebuilt row's projection on
its row is the row, the codes are those of the MSE-optimal scale, compiled equals eager, and bad options are
refused."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchkv.transforms as T
from torchkv.pipeline import COMPILE_OPTIONS
from torchkv.transforms import Context

UNIFORM = [{"bits": b, "axis": "token", "group": g, "symmetric": True, "step": "gaussian", "meta_dtype": "float32"}
           for b in (1, 2, 4) for g in (None, 16)]
HIGGS = [{"bits": 2, "dim": 4, "scale_dtype": "float32"}, {"bits": 1, "dim": 8, "scale_dtype": "float32"},
         {"bits": 2.5, "dim": 2, "span": "token", "scale_dtype": "float32"}]
CASES = [("uniform", c) for c in UNIFORM] + [("higgs", c) for c in HIGGS]


def _rows(t, x: torch.Tensor) -> torch.Tensor:
    """The rows one scale covers: `[..., rows, features]`."""
    cfg = t.config
    if t.name == "uniform":
        return x.unflatten(-1, (-1, cfg.group or x.shape[-1]))
    return x.transpose(1, 2).flatten(2)[:, :, None] if cfg.span == "token" else x[..., None, :]


@pytest.mark.parametrize("name,cfg", CASES, ids=str)
@given(seed=st.integers(0, 1000), offset=st.floats(0.0, 3.0))
def test_each_rebuilt_row_projects_onto_its_row_and_keeps_its_codes(name, cfg, seed, offset):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 16, 64, generator=g) * torch.rand(64, generator=g).exp() + offset
    ctx = Context(dim=64)
    plain, unbiased = T.quantize(name, **cfg), T.quantize(name, **cfg, unbiased=True)
    codes, state = plain.encode(x, ctx)
    codes_u, state_u = unbiased.encode(x, ctx)
    assert torch.equal(codes_u, codes)
    rows, rebuilt = _rows(plain, x), _rows(plain, unbiased.decode(codes_u, state_u, ctx))
    torch.testing.assert_close((rows * rebuilt).sum(-1), rows.square().sum(-1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,cfg,shrink", [("uniform", UNIFORM[0], 0.70), ("uniform", UNIFORM[2], 0.90),
                                             ("higgs", HIGGS[0], 0.92), ("higgs", HIGGS[1], 0.70)], ids=str)
def test_gaussian_rows_are_shrunk_by_the_mse_optimal_scale(name, cfg, shrink):
    """What the refit undoes: Gaussian rows (as after a Hadamard rotation) rebuilt from a 1- or 2-bit code keep
    `x·x̂/‖x‖²` of about one minus the code's relative MSE (0.64 at 1 bit, 0.88-0.90 at 2)."""
    x = torch.randn(1, 2, 512, 64, generator=torch.Generator().manual_seed(0))
    t = T.quantize(name, **cfg)
    x_hat = t.decode(*t.encode(x, Context(dim=64)), Context(dim=64))
    kept = (x * x_hat).sum() / x.square().sum()
    mse = (x - x_hat).square().sum() / x.square().sum()
    assert kept < shrink and abs(kept - (1 - mse)) < 0.05, (kept, mse)


@pytest.mark.parametrize("name,cfg", CASES, ids=str)
def test_compiled_equals_eager(name, cfg):
    torch.compiler.reset()
    t = T.quantize(name, **cfg, unbiased=True)
    x = torch.randn(2, 3, 32, 64, generator=torch.Generator().manual_seed(0))

    def roundtrip(x):
        ctx = Context(dim=64)
        y, state = t.encode(x, ctx)
        return y, t.decode(y, state, ctx)

    eager = roundtrip(x)
    compiled = torch.compile(roundtrip, fullgraph=True, options=COMPILE_OPTIONS)(x)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-5, atol=1e-5)


def test_a_zero_row_keeps_its_scale():
    t = T.quantize(bits=2, axis="token", group=None, symmetric=True, step="gaussian", unbiased=True)
    x = torch.zeros(1, 1, 2, 64)
    y, state = t.encode(x, Context(dim=64))
    assert torch.equal(t.decode(y, state, Context(dim=64)), x)


@pytest.mark.parametrize("factory,kwargs,error", [
    (T.quantize, {"bits": 2, "axis": "token", "group": 16, "unbiased": True}, "needs symmetric=True and axis='token'"),
    (T.quantize, {"bits": 2, "axis": "channel", "group": 16, "symmetric": True, "unbiased": True},
     "needs symmetric=True and axis='token'"),
    (lambda **kw: T.quantize("higgs", **kw), {"query_metric": True, "unbiased": True}, "unbiased=True or query_metric"),
])
def test_bad_options_are_refused(factory, kwargs, error):
    with pytest.raises(ValueError, match=error):
        factory(**kwargs)


def test_unbias_values_script_sets_the_value_quantizers_up_to_a_width_and_the_copy_loads(tmp_path):
    """`benchmarks/unbias_values.py` on the committed per-head folder (1- and 2-bit value groups): `--max-bits 1`
    unbiases the 1-bit value quantizers only, no limit every one, keys never; a width below every value's is refused."""
    from pathlib import Path

    from torchkv.pipeline import KVPipeline
    from torchkv.testing import load_script

    root = Path(__file__).resolve().parents[2]
    script = load_script(root / "benchmarks/unbias_values.py")
    src = root / "benchmarks/results/domains/tuned/frontier-2bit@2.5_mixed_per_head"

    def quantizers(pipe: KVPipeline, side: str) -> list:  # `chains()` lists a chain shared by layers once
        return [t for prefix, chain in pipe.chains() if prefix.endswith(f"{side}.")
                for t in chain.transforms if t.kind == "quantize"]

    values = quantizers(KVPipeline.from_pretrained(src), "v")
    assert 0 < sum(t.config.bits <= 1 for t in values) < len(values) and not any(t.config.unbiased for t in values)
    counts = {}  # quantizers set in the saved config, where layers with equal chains repeat them
    for max_bits in (1, None):
        out = tmp_path / str(max_bits)
        counts[max_bits] = script.unbias(src, out, max_bits)
        copy = KVPipeline.from_pretrained(out)
        assert all(t.config.unbiased == (max_bits is None or t.config.bits <= max_bits)
                   for t in quantizers(copy, "v"))
        assert not any(t.config.unbiased for t in quantizers(copy, "k"))
        assert (out / "tune.json").read_bytes() == (src / "tune.json").read_bytes()
    assert 0 < counts[1] < counts[None]
    with pytest.raises(ValueError, match="no value quantizer to unbias of at most 0.5 bits"):
        script.unbias(src, tmp_path / "none", 0.5)


def test_unbiased_values_copy_a_pipeline_with_its_marks_and_refuse_values_that_cannot_refit():
    """`torchkv.fitting.tuning.unbiased_values` (what `torchkv tune --unbiased-values` saves): a per-layer pipeline's
    value quantizers all set, keys untouched, the source unchanged, its tuning marks kept; KIVI's asymmetric
    per-token values cannot refit their scale and are refused with why."""
    from torchkv.fitting.tuning import unbiased_values
    from torchkv.pipeline import KVPipeline

    main = KVPipeline.from_preset("frontier-2bit")
    wide = KVPipeline.from_preset("frontier-2bit", bits=4)
    pipe = KVPipeline(main.keys.transforms, main.values.transforms, layers={1: (wide.keys.transforms,
                                                                                wide.values.transforms)})
    pipe.name, pipe.tuned_for, pipe.tuned_on = "tuned:frontier-2bit@2.5", {"layers": 2}, "code"
    copy, count = unbiased_values(pipe)
    assert count == 2 and copy.options["unbiased_values"] is True
    assert (copy.name, copy.tuned_for, copy.tuned_on) == (pipe.name, pipe.tuned_for, pipe.tuned_on)
    for layer in (0, 1):
        values = [t for t in copy.for_layer(layer).values.transforms if t.kind == "quantize"]
        keys = [t for t in copy.for_layer(layer).keys.transforms if t.kind == "quantize"]
        assert all(t.config.unbiased for t in values) and not any(t.config.unbiased for t in keys)
    assert not any(t.config.unbiased for t in pipe.values.transforms if t.kind == "quantize")
    assert unbiased_values(pipe, max_bits=2)[1] == 1
    with pytest.raises(ValueError, match="'kivi-2bit': its values cannot be read unbiased .*symmetric=True"):
        unbiased_values(KVPipeline.from_preset("kivi-2bit"))
