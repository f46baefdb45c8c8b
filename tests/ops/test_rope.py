import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from torchkv.ops import apply_rope


def _cos_sin(positions, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[..., None].float() * inv
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def test_matches_transformers_and_inverts():
    k = torch.randn(2, 3, 10, 64)
    cos, sin = _cos_sin(torch.arange(5, 15)[None].expand(2, 10), 64)
    _, expected = apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(apply_rope(k, cos, sin), expected)
    torch.testing.assert_close(apply_rope(apply_rope(k, cos, sin), cos, -sin), k, rtol=0, atol=1e-5)


def test_partial_rotary_leaves_the_rest():
    k = torch.randn(1, 2, 4, 64)
    cos, sin = _cos_sin(torch.arange(4)[None], 32)
    out = apply_rope(k, cos, sin)
    assert torch.equal(out[..., 32:], k[..., 32:])
