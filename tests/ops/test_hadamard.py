import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchkv.ops import hadamard, hadamard_block


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 128])
def test_matches_sylvester_matrix(n):
    x = torch.randn(5, n, dtype=torch.float64)
    torch.testing.assert_close(hadamard(x), x @ sylvester(n), rtol=1e-12, atol=1e-12)


@given(st.sampled_from([2, 8, 16, 64, 96, 80, 24]), st.integers(0, 1000))
def test_orthonormal_and_self_inverse(n, seed):
    x = torch.randn(4, 3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    y = hadamard(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    torch.testing.assert_close(hadamard(y), x, rtol=1e-12, atol=1e-12)
    eye = torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close(hadamard(eye) @ hadamard(eye).T, eye, rtol=0, atol=1e-12)


def test_block_diagonal_for_non_power_of_two():
    assert hadamard_block(96) == 32 and hadamard_block(80) == 16
    x = torch.randn(2, 96, dtype=torch.float64)
    expected = torch.cat([hadamard(part) for part in x.split(32, dim=-1)], dim=-1)
    torch.testing.assert_close(hadamard(x), expected)


def test_half_precision_and_compile():
    x = torch.randn(2, 3, 8, 64)
    assert hadamard(x.bfloat16()).dtype == torch.bfloat16
    torch.testing.assert_close(torch.compile(hadamard, fullgraph=True)(x), hadamard(x), rtol=0, atol=1e-6)


def test_bad_block():
    with pytest.raises(ValueError, match="power of two"):
        hadamard(torch.randn(2, 12), block=3)
