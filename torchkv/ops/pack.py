"""Dense bit packing of b-bit codes into bytes along the last axis.

Codes are packed in words of `L = lcm(b, 8) / b` codes into `lcm(b, 8) / 8` bytes, little end first:
1, 2, 4 and 8 bits pack 8, 4, 2, 1 codes per byte; 3 bits pack 8 codes into 3 bytes.
"""

import math

import torch

PACK_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def _word(bits: int) -> tuple[int, int]:
    """(codes per word, bytes per word) for `bits`-bit codes."""
    if bits not in PACK_BITS:
        raise ValueError(f"bits={bits} cannot be packed; allowed: {PACK_BITS}")
    word_bits = math.lcm(bits, 8)
    return word_bits // bits, word_bits // 8


def packed_size(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits occupy (the last word padded)."""
    codes_per_word, bytes_per_word = _word(bits)
    return -(-n // codes_per_word) * bytes_per_word


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes densely.

    Args:
        codes: [..., n] uint8, each < 2^bits.

    Returns:
        [..., packed_size(n, bits)] uint8.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_bits expects uint8 codes, got {codes.dtype}")
    codes_per_word, bytes_per_word = _word(bits)
    n = codes.shape[-1]
    pad = -n % codes_per_word
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    words = codes.unflatten(-1, (-1, codes_per_word)).long()  # [..., W, L]
    shifts = torch.arange(codes_per_word, device=codes.device) * bits
    value = (words << shifts).sum(-1, keepdim=True)  # [..., W, 1], < 2^56
    byte_shifts = torch.arange(bytes_per_word, device=codes.device) * 8
    return ((value >> byte_shifts) & 0xFF).to(torch.uint8).flatten(-2)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`.

    Args:
        packed: [..., packed_size(n, bits)] uint8.
        n: number of codes to return (the padding of the last word is dropped).

    Returns:
        [..., n] uint8.
    """
    codes_per_word, bytes_per_word = _word(bits)
    if packed.shape[-1] != packed_size(n, bits):
        raise ValueError(
            f"packed last axis has {packed.shape[-1]} bytes; {n} codes of {bits} bits need "
            f"{packed_size(n, bits)}"
        )
    words = packed.unflatten(-1, (-1, bytes_per_word)).long()  # [..., W, bytes]
    byte_shifts = torch.arange(bytes_per_word, device=packed.device) * 8
    value = (words << byte_shifts).sum(-1, keepdim=True)  # [..., W, 1]
    shifts = torch.arange(codes_per_word, device=packed.device) * bits
    codes = ((value >> shifts) & (2**bits - 1)).to(torch.uint8).flatten(-2)
    return codes[..., :n]
