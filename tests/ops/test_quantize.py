import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchkv.ops import GAUSSIAN_STEP, SUPPORTED_BITS, dequantize, quantize
from torchkv.pipeline import COMPILE_OPTIONS


def _reference(x, bits, dim, group, symmetric, scale, zero):
    """Naive fp64 codes for the stored scale/zero: round((x - m)/Δ), clamped."""
    qmax, dim = 2**bits - 1, dim % x.dim()
    xg = x.double().unflatten(dim, (x.shape[dim] // group, group))
    step = scale.double().unsqueeze(dim + 1)
    if symmetric:
        codes = torch.where(step > 0, xg / step, 0.0) + qmax / 2
    else:
        codes = torch.where(step > 0, (xg - zero.double().unsqueeze(dim + 1)) / step, 0.0)
    return codes.round().clamp(0, qmax).flatten(dim, dim + 1).to(torch.uint8)


@st.composite
def quant_case(draw):
    bits = draw(st.sampled_from(SUPPORTED_BITS))
    dim = draw(st.sampled_from([-1, -2]))
    group = draw(st.sampled_from([1, 2, 4, 8, 16]))
    groups = draw(st.integers(1, 4))
    other = draw(st.integers(1, 9))
    shape = (2, other, group * groups) if dim == -1 else (2, group * groups, other)
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    return x, bits, dim, group, draw(st.booleans()), draw(st.sampled_from([torch.float16, torch.float32]))


@given(quant_case())
def test_error_within_half_step(case):
    x, bits, dim, group, symmetric, meta = case
    codes, scale, zero = quantize(x, bits, dim, group, symmetric, meta)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2**bits - 1
    assert scale.dtype == meta and (zero is None) == symmetric
    xhat = dequantize(codes, scale, zero, bits, dim, group)
    half_step = scale.float().repeat_interleave(group, dim=dim % x.dim()) / 2
    assert torch.all((xhat - x).abs() <= half_step * (1 + 1e-5) + 1e-6)


@given(quant_case())
def test_codes_match_naive_reference(case):
    x, bits, dim, group, symmetric, meta = case
    codes, scale, zero = quantize(x, bits, dim, group, symmetric, meta)
    ref = _reference(x, bits, dim, group, symmetric, scale, zero)
    # float32 vs float64 division may differ only at exact rounding ties
    assert (codes.int() - ref.int()).abs().max() <= 1
    assert (codes != ref).float().mean() < 0.01


def test_zero_range_group_is_exact():
    x = torch.full((1, 4, 8), 3.25)
    codes, scale, zero = quantize(x, 2, -1, 4, meta_dtype=torch.float32)
    assert torch.equal(dequantize(codes, scale, zero, 2, -1, 4), x)
    assert torch.all(codes == 0)
    zeros = torch.zeros(1, 4, 8)
    assert torch.equal(dequantize(*quantize(zeros, 2, -1, 4), 2, -1, 4), zeros)


def test_one_bit_gives_group_min_or_max():
    x = torch.randn(3, 16, 8)
    codes, scale, zero = quantize(x, 1, -2, 16, meta_dtype=torch.float32)
    xhat = dequantize(codes, scale, zero, 1, -2, 16)
    lo, hi = x.amin(-2, keepdim=True), x.amax(-2, keepdim=True)
    assert torch.all(torch.isclose(xhat, lo.expand_as(x)) | torch.isclose(xhat, hi.expand_as(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim,shape", [(-1, (2, 3, 232, 64)), (-2, (2, 3, 64, 232))])
def test_matrix_bound_and_sqnr(dtype, bits, dim, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    group = 8 if shape[dim] == 232 else 32
    codes, scale, zero = quantize(x, bits, dim, group)
    xhat = dequantize(codes, scale, zero, bits, dim, group, dtype=torch.float32)
    err = (xhat - x.float()).abs()
    assert torch.all(err <= scale.float().repeat_interleave(group, dim=dim % 4) / 2 * (1 + 1e-5) + 1e-6)
    # each extra bit buys ~6 dB on Gaussian data
    noise = err.pow(2).mean()
    assert 10 * torch.log10(x.float().pow(2).mean() / noise) > 6.0 * bits - 5


def test_padding_stays_out_of_statistics():
    x = torch.randn(2, 1, 32, 4)
    valid = torch.ones(2, 32, dtype=torch.bool)
    valid[0, :5] = False
    polluted = x.clone()
    polluted[0, :, :5] = 1e4
    codes, scale, zero = quantize(polluted, 2, -2, 32, valid=valid[:, None, :, None])
    clean_codes, clean_scale, clean_zero = quantize(x[0:1, :, 5:], 2, -2, 27)
    assert torch.equal(scale[0:1], clean_scale) and torch.equal(zero[0:1], clean_zero)
    assert torch.equal(codes[0:1, :, 5:], clean_codes)
    # a group with no valid element reconstructs to zeros, never NaN
    valid[1] = False
    codes, scale, zero = quantize(polluted, 2, -2, 32, valid=valid[:, None, :, None])
    assert torch.equal(dequantize(codes, scale, zero, 2, -2, 32)[1], torch.zeros(1, 32, 4))


def test_nan_does_not_corrupt_other_groups():
    x = torch.randn(2, 4, 64)
    dirty = x.clone()
    dirty[0, 1, 3] = float("nan")
    dirty[1, 2, 40] = float("inf")
    clean = dequantize(*quantize(x, 4, -1, 32), 4, -1, 32)
    got = dequantize(*quantize(dirty, 4, -1, 32), 4, -1, 32)
    untouched = torch.ones_like(x, dtype=torch.bool)
    untouched[0, 1, :32] = False
    untouched[1, 2, 32:] = False
    assert torch.equal(got[untouched], clean[untouched])


def test_compiled_equals_eager():
    x = torch.randn(2, 3, 64, 64)

    def roundtrip(x):
        codes, scale, zero = quantize(x, 3, -2, 32)
        return codes, dequantize(codes, scale, zero, 3, -2, 32)

    eager = roundtrip(x)
    compiled = torch.compile(roundtrip, fullgraph=True, options=COMPILE_OPTIONS)(x)
    assert torch.equal(eager[0], compiled[0])
    torch.testing.assert_close(eager[1], compiled[1], rtol=0, atol=1e-6)
    # the error bound holds for the compiled path too
    assert torch.all((compiled[1] - x).abs() <= 0.5 * quantize(x, 3, -2, 32)[1].float().repeat_interleave(32, 2) + 1e-6)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"bits": 9, "dim": -1, "group": 4}, "bits=9"),
        ({"bits": 0, "dim": -1, "group": 4}, "bits=0"),
        ({"bits": 2, "dim": -1, "group": 5}, "group=5 must divide"),
        ({"bits": 2, "dim": -1, "group": 4, "step": "gaussian"}, "'gaussian' with symmetric=True"),
        ({"bits": 2, "dim": -1, "group": 4, "step": "rms"}, "step='rms' is not supported"),
    ],
)
def test_bad_arguments_are_clear(kwargs, error):
    with pytest.raises(ValueError, match=error):
        quantize(torch.randn(2, 8), **kwargs)


def test_integer_input_is_rejected():
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(2, 8, dtype=torch.int32), 2, -1, 4)


@given(bits=st.sampled_from(SUPPORTED_BITS), group=st.sampled_from([16, 64]), seed=st.integers(0, 10_000),
       meta=st.sampled_from([torch.float16, torch.float8_e5m2]))
def test_gaussian_step_takes_each_value_to_its_nearest_level(bits, group, seed, meta):
    """step="gaussian": Δ = κ_b·rms rounded to the stored dtype, and every value decodes to the nearest of the
    2^b levels `(c − (2^b−1)/2)·Δ` (values beyond the outer levels clip to them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 8, 128, generator=g) * torch.rand(2, 3, 8, 1, generator=g) * 10
    codes, scale, zero = quantize(x, bits, -1, group, True, meta, step="gaussian")
    assert zero is None
    rms = x.unflatten(-1, (-1, group)).square().mean(-1).sqrt()
    torch.testing.assert_close(scale.float(), (rms * GAUSSIAN_STEP[bits]).to(meta).float(), rtol=0, atol=0)
    xhat = dequantize(codes, scale, None, bits, -1, group)
    step = scale.float().repeat_interleave(group, -1)[..., None, :]  # [..., 1, D]
    levels = (torch.arange(2**bits) - (2**bits - 1) / 2)[:, None] * step  # [..., 2^b, D]
    nearest = (levels - x[..., None, :]).abs().amin(-2)  # [..., D]
    torch.testing.assert_close((xhat - x).abs(), nearest, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_gaussian_steps_minimise_the_normal_mse(bits):
    """κ_b is the MSE-optimal uniform step for N(0, 1) (closed-form check by quadrature): 1% either way is worse."""
    t = torch.linspace(-12, 12, 400_001, dtype=torch.float64)
    density = torch.exp(-t * t / 2) * (t[1] - t[0]) / (2 * torch.pi) ** 0.5
    qmax = 2**bits - 1

    def mse(step: float) -> float:
        level = (torch.round(t / step + qmax / 2).clamp(0, qmax) - qmax / 2) * step
        return float(((level - t) ** 2 * density).sum())

    best = mse(GAUSSIAN_STEP[bits])
    assert best < mse(GAUSSIAN_STEP[bits] * 1.01) and best < mse(GAUSSIAN_STEP[bits] * 0.99)
