"""Dense bit packing of b-bit codes into bytes along the last axis.

Two layouts, both dense:

- planar (1, 2, 4, 8 bits; `p = 8/b` codes per byte): the n codes (padded to a multiple of p) are
  split into p planes of `m = n/p` consecutive codes; byte j holds code `i·m + j` of every plane i at
  bit offset `b·i`. Unpacking plane i is one shift and mask of all m bytes, which vectorizes, so
  decode attention can read codes straight from the packed bytes.
- words (3, 5, 6, 7 bits): `L = lcm(b, 8)/b` consecutive codes fill `lcm(b, 8)/8` bytes, little end
  first (3 bits: 8 codes in 3 bytes).
"""

import math

import torch

PACK_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
PLANAR_BITS = (1, 2, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in PACK_BITS:
        raise ValueError(f"bits={bits} cannot be packed; allowed: {PACK_BITS}")


def _word(bits: int) -> tuple[int, int]:
    """(codes per word, bytes per word) of the word layout."""
    word_bits = math.lcm(bits, 8)
    return word_bits // bits, word_bits // 8


def packed_size(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits occupy (the last plane or word padded)."""
    _check_bits(bits)
    if bits in PLANAR_BITS:
        return -(-n * bits // 8)
    codes_per_word, bytes_per_word = _word(bits)
    return -(-n // codes_per_word) * bytes_per_word


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes densely.

    Args:
        codes: [..., n] uint8, each < 2^bits.

    Returns:
        [..., packed_size(n, bits)] uint8.
    """
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_bits expects uint8 codes, got {codes.dtype}")
    if bits == 8:
        return codes
    n = codes.shape[-1]
    if bits in PLANAR_BITS:
        per = 8 // bits
        codes = torch.nn.functional.pad(codes, (0, -n % per))
        planes = codes.unflatten(-1, (per, -1))  # [..., p, m]
        shifts = torch.arange(per, dtype=torch.uint8, device=codes.device) * bits
        return (planes << shifts[:, None]).sum(-2, dtype=torch.uint8)
    codes_per_word, bytes_per_word = _word(bits)
    codes = torch.nn.functional.pad(codes, (0, -n % codes_per_word))
    words = codes.unflatten(-1, (-1, codes_per_word)).long()  # [..., W, L]
    shifts = torch.arange(codes_per_word, device=codes.device) * bits
    value = (words << shifts).sum(-1, keepdim=True)  # [..., W, 1], < 2^56
    byte_shifts = torch.arange(bytes_per_word, device=codes.device) * 8
    return ((value >> byte_shifts) & 0xFF).to(torch.uint8).flatten(-2)


def unpack_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The planes of planar-packed codes: [..., m] uint8 (or its bytes widened to an integer type) -> [..., 8/bits,
    m] of the same type (plane i, byte j is code `i·m + j`; flattening the last two axes gives the codes in
    order)."""
    if bits not in PLANAR_BITS:
        raise ValueError(f"bits={bits} has no planar layout; planar widths: {PLANAR_BITS}")
    shifts = torch.arange(8 // bits, dtype=torch.uint8, device=packed.device) * bits
    return (packed[..., None, :] >> shifts[:, None]) & (2**bits - 1)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`.

    Args:
        packed: [..., packed_size(n, bits)] uint8.
        n: number of codes to return (the padding is dropped).

    Returns:
        [..., n] uint8.
    """
    _check_bits(bits)
    if packed.shape[-1] != packed_size(n, bits):
        raise ValueError(
            f"packed last axis has {packed.shape[-1]} bytes; {n} codes of {bits} bits need "
            f"{packed_size(n, bits)}"
        )
    if bits in PLANAR_BITS:
        return unpack_planes(packed, bits).flatten(-2)[..., :n]
    # code l of a word starts at bit l·b of it (little end first), so the word's byte l·b // 8 and the next hold it:
    # fixed slices of the bytes, which compiled decode reductions read without 64-bit arithmetic per code
    codes_per_word, bytes_per_word = _word(bits)
    words = packed.unflatten(-1, (-1, bytes_per_word)).int()  # [..., W, bytes]
    codes = []
    for at in range(0, codes_per_word * bits, bits):
        pair = words[..., at // 8] | (words[..., at // 8 + 1] << 8 if at // 8 + 1 < bytes_per_word else 0)
        codes.append((pair >> at % 8) & (2**bits - 1))
    return torch.stack(codes, -1).flatten(-2)[..., :n].to(torch.uint8)
