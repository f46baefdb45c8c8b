"""The Triton HIGGS encoding kernel (rotation and nearest grid point fused) equals its eager reference, and
`higgs_quantize`, the HIGGS transform and a frontier pipeline give the codes of the eager path through it.

Without a GPU the kernel runs on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`, set by conftest)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchkv
from torchkv.ops import GRIDS, hadamard, hadamard_block, higgs_quantize, load_grid, triton_decode, triton_higgs_encode

pytestmark = pytest.mark.skipif(triton_decode.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _distances(x, inv, grid, block, codes):
    """Squared distance of each rotated, scaled d-vector to the grid point `codes` names: [M, F/d]."""
    y = (hadamard(x, block) * inv[:, None]).unflatten(-1, (-1, grid.shape[1]))
    return (y - grid[codes.long()]).square().sum(-1)


def assert_nearest(x, inv, grid, block, got):
    """`got` names a nearest grid point of every d-vector: the reference's codes, or (where the rotation's rounding
    in a dot against the matrix and in the butterfly differ) a point as near within float32 rounding."""
    expected = triton_higgs_encode.higgs_encode_reference(x, inv, grid, block)
    assert got.shape == expected.shape and got.dtype == torch.uint8
    differ = got != expected
    near = _distances(x, inv, grid, block, got) - _distances(x, inv, grid, block, expected)
    assert near[differ].abs().le(1e-4).all()
    assert differ.sum() <= 0.01 * differ.numel()


@st.composite
def cases(draw):
    d, n = draw(st.sampled_from(GRIDS))
    f = draw(st.sampled_from([f for f in (8, 32, 64, 80, 192) if f % d == 0]))
    blocks = [b for b in (8, 16, 32, 64) if f % b == 0 and b >= d]
    return dict(d=d, n=n, f=f, block=draw(st.sampled_from(blocks)), rows=draw(st.integers(0, 40)),
                zero_rows=draw(st.integers(0, 3)), size=draw(st.sampled_from([1e-6, 1.0, 300.0])),
                seed=draw(st.integers(0, 99)))


@settings(max_examples=8)  # the interpreter scans a 256-point grid in about 0.1 s per block of rows
@given(c=cases())
def test_kernel_equals_eager_reference(c):
    g = torch.Generator().manual_seed(c["seed"])
    x = (torch.randn(c["rows"], c["f"], generator=g) * 2 + 0.3) * c["size"]
    x[: c["zero_rows"]] = 0
    norm = torch.linalg.vector_norm(x, dim=-1)
    inv = torch.where(norm > 0, math.sqrt(c["f"]) / norm.clamp_min(1e-30), 0.0)
    grid = load_grid(c["n"], c["d"])
    x, inv, grid = x.to(DEVICE), inv.to(DEVICE), grid.to(DEVICE)
    got = triton_higgs_encode.higgs_encode(x, inv, grid, c["block"])
    assert_nearest(x, inv, grid, c["block"], got)


@pytest.mark.parametrize("d, n, dtype", [(2, 256, "float32"), (4, 256, "float8_e5m2"), (8, 256, "float16")])
def test_higgs_quantize_through_the_kernel(d, n, dtype, monkeypatch):
    """`higgs_quantize` on a device with the kernel: the eager path's scales, and its codes up to rounding ties."""
    x = torch.randn(2, 2, 40, 64, generator=torch.Generator().manual_seed(d)).to(DEVICE) * 4
    grid = load_grid(n, d).to(DEVICE)
    scale_dtype = getattr(torch, dtype)
    monkeypatch.setattr(triton_decode, "runs_on", lambda device: False)
    codes, scale = higgs_quantize(x, grid, scale_dtype=scale_dtype)
    monkeypatch.setattr(triton_decode, "runs_on", lambda device: True)
    got, got_scale = higgs_quantize(x, grid, scale_dtype=scale_dtype)
    assert torch.equal(got_scale, scale) and got.shape == codes.shape
    inv = torch.where(scale.float() > 0, 8 / scale.float(), 0.0).reshape(-1)
    assert_nearest(x.reshape(-1, 64), inv, grid, hadamard_block(64), got.reshape(-1, 64 // d))


def test_grids_beyond_a_byte_and_blocks_beyond_128_keep_the_eager_path(monkeypatch):
    monkeypatch.setattr(triton_decode, "runs_on", lambda device: True)
    x = torch.zeros(2, 256, device=DEVICE)
    assert triton_higgs_encode.runs_on(x, torch.zeros(256, 4), 128)
    assert not triton_higgs_encode.runs_on(x, torch.zeros(257, 4), 128)
    assert not triton_higgs_encode.runs_on(x, torch.zeros(256, 4), 256)  # Gemma 3's 256-wide heads
    calls = []
    monkeypatch.setattr(triton_higgs_encode, "higgs_encode", lambda *args: calls.append(args))
    higgs_quantize(torch.randn(3, 256, device=DEVICE), load_grid(256, 4).to(DEVICE))
    assert not calls
    monkeypatch.setattr(triton_decode, "runs_on", lambda device: False)
    assert not triton_higgs_encode.runs_on(x, torch.zeros(256, 4), 128)


@pytest.mark.parametrize("span", ["head", "token"])
def test_pipeline_encodes_through_the_kernel(span, monkeypatch):
    """A frontier pipeline (balanced keys, 4-bit keys on the 2-D grid for `span`) encodes a chunk to the eager
    path's codes through the kernel, under torch.compile too (the op is one opaque call in the graph)."""
    pipe = torchkv.KVPipeline.from_preset("frontier-2bit", key_bits=4, span=span, compile=False)
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(2, 3, pipe.chunk, 64, generator=g).to(DEVICE) for _ in range(2))
    prepared = pipe.prepare(k, v, inputs={"queries": torch.randn(2, 9, pipe.chunk, 64, generator=g).to(DEVICE)})
    monkeypatch.setattr(triton_decode, "runs_on", lambda device: False)
    expected = pipe.encode_chunk(k, v, prepared=prepared)
    monkeypatch.setattr(triton_decode, "runs_on", lambda device: True)
    compiled = torch.compile(lambda k, v: pipe.encode_chunk(k, v, prepared=prepared), backend="aot_eager",
                             fullgraph=True)
    for got in (pipe.encode_chunk(k, v, prepared=prepared), compiled(k, v)):
        assert got.keys() == expected.keys()
        differ = {name: (got[name] != expected[name]).float().mean().item() for name in got}
        assert differ["k.out"] <= 0.01 and all(share == 0 for name, share in differ.items() if name != "k.out")
