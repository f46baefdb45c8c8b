import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchkv.ops import PACK_BITS, pack_bits, packed_size, unpack_bits, unpack_planes


@given(st.sampled_from(PACK_BITS), st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_roundtrip_exact_any_length(bits, n, seed):
    codes = torch.randint(0, 2**bits, (3, 2, n), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, packed_size(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes)


@pytest.mark.parametrize("bits,codes_per_bytes", [(1, (8, 1)), (2, (4, 1)), (3, (8, 3)), (4, (2, 1)), (8, (1, 1))])
def test_density(bits, codes_per_bytes):
    n, nbytes = codes_per_bytes
    assert packed_size(n, bits) == nbytes
    assert packed_size(64, bits) == 64 * bits // 8


def test_known_layouts():
    # planar: byte j holds code i*m + j of every plane i (m = n / codes per byte)
    codes = torch.tensor([1, 2, 3, 0, 2, 1, 0, 3], dtype=torch.uint8)
    assert pack_bits(codes, 2).tolist() == [1 | 3 << 2 | 2 << 4 | 0 << 6, 2 | 0 << 2 | 1 << 4 | 3 << 6]
    assert unpack_planes(pack_bits(codes, 2), 2).tolist() == [[1, 2], [3, 0], [2, 1], [0, 3]]
    # words: 3-bit codes fill 3 bytes per 8 codes, little end first
    three = torch.arange(8, dtype=torch.uint8)
    value = sum(c << (3 * i) for i, c in enumerate(range(8)))
    assert pack_bits(three, 3).tolist() == [value & 255, value >> 8 & 255, value >> 16]


def test_compiled_equals_eager():
    codes = torch.randint(0, 8, (2, 3, 32, 64), dtype=torch.uint8)

    def roundtrip(c):
        p = pack_bits(c, 3)
        return p, unpack_bits(p, 3, 64)

    eager, compiled = roundtrip(codes), torch.compile(roundtrip, fullgraph=True)(codes)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], codes) and torch.equal(compiled[1], codes)


def test_errors():
    with pytest.raises(ValueError, match="bits=9"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), 9)
    with pytest.raises(TypeError, match="uint8"):
        pack_bits(torch.zeros(8, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="need"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 2, 64)
