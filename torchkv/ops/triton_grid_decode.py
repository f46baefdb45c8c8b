"""Split-K decode attention over vector-coded keys and rotated per-token values (the frontier presets' stored
form), as Triton kernels, beside its eager reference.

The stored form:
- keys (`quantize.higgs`, 256-, 128-, 64- or 32-point grids): per `d`-D group of channels the index of a grid
  point, one byte each (8-bit codes) or packed in words (5-, 6- and 7-bit codes, eight, four and eight in 5, 3 and
  7 bytes, so a token's codes are one little-endian bit string), and one multiplier per token (and KV head, or per
  token for every head); a key in the quantizer's rotated domain is `k̂_t = m_t·r·[grid[c_t1], ..., grid[c_tK]]`
  (r = 1/√row size);
- values (`quantize.uniform` per token, symmetric, planar-packed): `v̂_td = (c_td − (2^b − 1)/2)·Δ_t`, in the
  domain of the transforms before the quantizer (a Hadamard rotation).

`grid_decode` computes `softmax(q·[k̂; k_fp]ᵀ)·[v̂; v_fp]` like `triton_decode.kivi_decode`, with the same
grid of programs (B·H, S + 1), GQA inside each program, online softmax and log-sum-exp combine. Each block of
tokens gathers its keys' grid points (at most a 256·d table of float32, which stays in the L1 cache) into registers and
scores them with one dot against the query rotated into the quantizer's domain. The caller rotates the query once
per step, maps the full-precision values into the values' stored domain (F tokens, a window's worth) and maps the
output back once.

Float8 metadata is read as bytes and widened in registers (the interpreter has no float8).
"""

import torch

from torchkv.ops import triton_decode
from torchkv.ops.triton_decode import _dot, _splits, triton

#: key code widths the kernel reads: a byte per code (256-point grids), or words of 5-, 6- or 7-bit codes (32, 64 or
#: 128 points). 4-bit codes (16 points) are planar-packed, which is not one bit string per token
CODE_BITS = (5, 6, 7, 8)
#: metadata dtypes read as bytes, with (mantissa bits, exponent bias): the kernels widen them in registers
FLOAT8 = {torch.float8_e5m2: (2, 15), torch.float8_e4m3fn: (3, 7)}


def grid_decode_reference(q_enc, q_fp, kc, ks, grid, vc, vs, kf, vf, mask, bias, live, softcap: float,
                          noise, key_norm: float, bits_v: int, code_bits: int):
    """Eager reference of `grid_decode` (dequantizes the whole history; for tests only). Shapes as `grid_decode`."""
    from torchkv.ops.pack import unpack_bits

    d = q_fp.shape[-1]
    codes = unpack_bits(kc, code_bits, d // grid.shape[-1]).long()  # [B, H, TE, K]
    mult = ks.float() * key_norm  # [B, H or 1, TE]
    k_hat = grid[codes].flatten(-2) * mult[..., None]  # [B, H, TE, D]
    if noise is not None:  # a bias per query head and token: the noise correction, with any bias given
        b, hq = noise.shape
        h = kc.shape[1]
        mult = mult.expand(b, h, -1).repeat_interleave(hq // h, 1)  # [B, Hq, TE]
        given = 0.0 if bias is None else bias if bias.dim() == 3 else bias[..., None]
        bias = given - noise[..., None] * mult.square()
    v_hat = (unpack_bits(vc, bits_v, d).float() - (2**bits_v - 1) / 2) * vs.float()[..., None]
    return triton_decode.reference_attention(q_enc, q_fp, k_hat, v_hat, kf, vf, mask, bias, live, softcap)


if triton is not None:
    import triton.language as tl

    from torchkv.ops.triton_decode import (_codes, _full_precision_part, _online, _planar, _scored, _split_bounds,
                                           _store_partial, _token_bias)

    @triton.jit
    def _meta(ptr, at, ok, MANT: tl.constexpr, BIAS: tl.constexpr):
        """Metadata at `at` as float32: stored in its own dtype (MANT == 0), or float8 bytes with MANT mantissa
        bits and exponent bias BIAS, widened (finite values; subnormals included)."""
        if MANT == 0:
            return tl.load(ptr + at, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(ptr + at, mask=ok, other=0).to(tl.int32)
        e = (u >> MANT) & ((1 << (7 - MANT)) - 1)
        m = u & ((1 << MANT) - 1)
        mag = tl.where(e == 0, m, m + (1 << MANT)).to(tl.float32) * \
            tl.exp2((tl.maximum(e, 1) - BIAS - MANT).to(tl.float32))
        return tl.where((u >> 7) != 0, -mag, mag)

    @triton.jit
    def _grid_codes(kc, row, tmask, K, KB, CODE_BITS: tl.constexpr, K_PAD: tl.constexpr):
        """The K grid indices [BLOCK, K_PAD] int32 of the tokens at `row`s (KB bytes each): one byte per code, or
        codes of CODE_BITS < 8 read from the token's little-endian bit string (two bytes hold each one)."""
        ok = tl.arange(0, K_PAD)
        read = tmask[:, None] & (ok < K)[None, :]
        if CODE_BITS == 8:
            codes = tl.load(kc + row[:, None] * KB + ok[None, :], mask=read, other=0).to(tl.int32)
        else:
            at = ok * CODE_BITS
            byte = row[:, None] * KB + (at >> 3)[None, :]
            low = tl.load(kc + byte, mask=read, other=0).to(tl.int32)
            high = tl.load(kc + byte + 1, mask=read & ((at >> 3) + 1 < KB)[None, :], other=0).to(tl.int32)
            codes = ((low | (high << 8)) >> (at & 7)[None, :]) & ((1 << CODE_BITS) - 1)
        return codes

    @triton.jit
    def _grid_scores(q, kc, ks, grid, row, srow, tmask, extra, noise, key_norm, K, KB,
                     DG: tl.constexpr, K_PAD: tl.constexpr, CODE_BITS: tl.constexpr, BLOCK: tl.constexpr,
                     K_MANT: tl.constexpr, K_BIAS: tl.constexpr, HAS_NOISE: tl.constexpr, DOT: tl.constexpr,
                     PRECISION: tl.constexpr):
        """q · k̂ [BLOCK_G, BLOCK] of the tokens at `row`s: their K grid indices gathered to points in registers
        [BLOCK, K_PAD·DG] (channel order), one dot, each token's multiplier m applied to its column; with HAS_NOISE,
        less `noise·m²` (`noise` [BLOCK_G]: each query head's half noise variance per squared multiplier)."""
        codes = _grid_codes(kc, row, tmask, K, KB, CODE_BITS, K_PAD)
        j = tl.arange(0, DG)
        points = tl.load(grid + codes[:, :, None] * DG + j[None, None, :])  # [BLOCK, K_PAD, DG]
        k = tl.reshape(points, (BLOCK, K_PAD * DG))
        s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PRECISION)
        mult = _meta(ks, srow, tmask, K_MANT, K_BIAS) * key_norm
        if HAS_NOISE:
            return s * mult[None, :] - noise[:, None] * (mult * mult)[None, :] + extra[:, None]
        return s * mult[None, :] + extra[:, None]

    @triton.jit
    def _symmetric_values(vc, vs, row, tmask, MV, BITS_V: tl.constexpr, MV_PAD: tl.constexpr, BLOCK: tl.constexpr,
                          V_MANT: tl.constexpr, V_BIAS: tl.constexpr):
        """Values [BLOCK, P·MV_PAD] (fp32, planar column order) of token `row`s: symmetric codes, one step each."""
        step = _meta(vs, row, tmask, V_MANT, V_BIAS)
        codes = _codes(vc, row, tmask, MV, BITS_V, MV_PAD, BLOCK).to(tl.float32)
        return (codes - ((1 << BITS_V) - 1) / 2) * step[:, None]

    @triton.jit
    def _grid_split_kernel(
        q_enc, q_fp, kc, ks, grid, vc, vs, kf, vf, mask, bias, live, noise,
        part_o, part_m, part_l, s_fp,
        H, SH, TE, F, K, KB, MV, SPLIT, NSPLIT, mask_rows, mask_cols, softcap, key_norm,
        G: tl.constexpr, D: tl.constexpr, DG: tl.constexpr, K_PAD: tl.constexpr, CODE_BITS: tl.constexpr,
        BITS_V: tl.constexpr, MV_PAD: tl.constexpr,
        K_MANT: tl.constexpr, K_BIAS: tl.constexpr, V_MANT: tl.constexpr, V_BIAS: tl.constexpr,
        HAS_MASK: tl.constexpr, HEAD_BIAS: tl.constexpr, TOKEN_BIAS: tl.constexpr, HAS_LIVE: tl.constexpr,
        HAS_NOISE: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One split of one (batch row, KV head): its GQA group's partial softmax over encoded tokens [start, end),
        or, for the last split, over the full-precision tokens."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H
        og = tl.arange(0, BLOCK_G)
        ob = tl.arange(0, BLOCK)
        gmask = og < G
        hq = bh * G + og  # query heads of this KV head, as rows of q [B·Hq, D]
        mrow = (b % mask_rows) * mask_cols
        dv, dv_ok = _planar(BITS_V, MV, MV_PAD, D)  # the output's columns: value channels in planar order
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, (8 // BITS_V) * MV_PAD], tl.float32)
        if split < NSPLIT:  # encoded tokens [start, end)
            dk = tl.arange(0, K_PAD * DG)  # key channels in order; channel d is point d % DG of group d // DG
            q = tl.load(q_enc + hq[:, None] * D + dk[None, :], mask=gmask[:, None] & (dk < D)[None, :], other=0.0)
            start, end, extra = _split_bounds(split, SPLIT, TE, bias, hq, gmask, live, BLOCK_G, HEAD_BIAS, HAS_LIVE)
            scale_head = (bh - b * H) % SH  # a multiplier per token and head (SH = H) or per token (SH = 1)
            nz = m  # unread without HAS_NOISE
            if HAS_NOISE:
                nz = tl.load(noise + hq, mask=gmask, other=0.0)
            for t0 in range(start, end, BLOCK):
                t = t0 + ob
                tmask = t < end
                row = bh * TE + t  # token row of the [B·H, TE, ...] tensors
                s = _grid_scores(q, kc, ks, grid, row, (b * SH + scale_head) * TE + t, tmask, extra, nz, key_norm,
                                 K, KB, DG, K_PAD, CODE_BITS, BLOCK, K_MANT, K_BIAS, HAS_NOISE, DOT, PRECISION)
                s = _token_bias(s, bias, hq, t, gmask, tmask, TE, TOKEN_BIAS)
                s = _scored(s, t, tmask, mask, mrow, softcap, SOFTCAP, HAS_MASK)
                v = _symmetric_values(vc, vs, row, tmask, MV, BITS_V, MV_PAD, BLOCK, V_MANT, V_BIAS)
                m, l, acc = _online(s, m, l, acc, v, DOT, PRECISION)
        else:
            m, l, acc = _full_precision_part(q_fp, kf, vf, s_fp, mask, mrow, softcap, m, l, acc, bh, hq, gmask, dv,
                                             dv_ok, TE, F, D, HAS_MASK, SOFTCAP, BLOCK_D, BLOCK, DOT, PRECISION)
        _store_partial(part_o, part_m, part_l, m, l, acc, hq, gmask, split, NSPLIT, dv, dv_ok, D)


def _stored(meta: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Metadata as the kernel reads it: (tensor, mantissa bits, exponent bias); float8 as its bytes, (0, 0) else."""
    if meta.dtype in FLOAT8:
        return meta.contiguous().view(torch.uint8), *FLOAT8[meta.dtype]
    return meta.contiguous(), 0, 0


@torch.library.custom_op("torchkv::grid_decode", mutates_args=())
def grid_decode(
    q_enc: torch.Tensor, q_fp: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor, grid: torch.Tensor,
    vc: torch.Tensor, vs: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, mask: torch.Tensor | None,
    bias: torch.Tensor | None, live: torch.Tensor | None, softcap: float, noise: torch.Tensor | None,
    key_norm: float, bits_v: int, code_bits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode attention of one query per row over grid-coded keys, symmetric per-token value codes and
    full-precision tokens.

    Args:
        q_enc: [B, Hq, D] float32, the (scaled) query in the keys' quantized domain; q_fp: the query as the
            full-precision keys read it. Query head i reads KV head i // (Hq/H).
        kc: [B, H, TE, KB] uint8: K = D/d grid indices of `code_bits` bits (8: one byte each; 6: packed in words,
            `ops.pack`); ks: [B, H or 1, TE] each token's multiplier (float16, float32 or float8); grid:
            [2^code_bits, d] float32; key_norm: r, the factor every multiplier takes.
        vc: [B, H, TE, MV] uint8 planar value codes of `bits_v` bits; vs: [B, H, TE] each token's step.
        kf, vf: [B, H, F, D] the full-precision tokens (sinks, window, new), after the encoded ones; vf in the
            values' stored domain.
        mask, bias, live, softcap: as in `triton_decode.kivi_decode` (a bias per token: a turned centre's offsets).
        noise: None, or [B, Hq] float32, each query head's half score-noise variance per squared multiplier
            (`HiggsQuantize.token_noise`): an encoded token's score less `noise·(m·r)²`, before soft-capping.

    Returns:
        out [B, Hq, D] float32, in the values' stored domain; lse [B, Hq]; s_fp [B, Hq, F], as `kivi_decode`.
    """
    b, hq, d = q_fp.shape
    h, te, kb = kc.shape[1:]
    f, mv = kf.shape[2], vc.shape[-1]
    dg = grid.shape[-1]
    k = d // dg
    g = hq // h
    per, nsplit = _splits(b * h, te)
    parts = nsplit + 1
    dev = q_fp.device
    part_o = torch.empty(b * hq * parts, d, dtype=torch.float32, device=dev)
    part_m = torch.empty(b * hq * parts, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    s_fp = torch.empty(b, hq, f, dtype=torch.float32, device=dev)
    block_d = max(16, triton.next_power_of_2(d))
    (ks, k_mant, k_bias), (vs, v_mant, v_bias) = _stored(ks), _stored(vs)
    unread = part_m  # stands for an absent mask, bias or live count, which the kernel then never reads
    _grid_split_kernel[(b * h, parts)](
        q_enc.contiguous(), q_fp.contiguous(), kc.contiguous(), ks, grid.contiguous().float(), vc.contiguous(), vs,
        kf.contiguous(), vf.contiguous(),
        unread if mask is None else mask.contiguous().view(torch.uint8), unread if bias is None else bias.contiguous(),
        unread if live is None else live, unread if noise is None else noise.contiguous(), part_o, part_m, part_l,
        s_fp,
        h, ks.shape[1], te, f, k, kb, mv,
        per, nsplit, 1 if mask is None else mask.shape[0], te + f, float(softcap), float(key_norm),
        G=g, D=d, DG=dg, K_PAD=triton.next_power_of_2(k), CODE_BITS=code_bits, BITS_V=bits_v,
        MV_PAD=triton.next_power_of_2(mv),
        K_MANT=k_mant, K_BIAS=k_bias, V_MANT=v_mant, V_BIAS=v_bias,
        HAS_MASK=mask is not None, **triton_decode.bias_flags(bias, b, hq, te), HAS_LIVE=live is not None,
        HAS_NOISE=noise is not None, SOFTCAP=bool(softcap), BLOCK_G=max(16, triton.next_power_of_2(g)),
        BLOCK_D=block_d, BLOCK=triton_decode.BLOCK_T,
        **_dot(kf.dtype), num_warps=triton_decode.NUM_WARPS, num_stages=triton_decode.NUM_STAGES,
    )
    out = torch.empty(b, hq, d, dtype=torch.float32, device=dev)
    lse = torch.empty(b, hq, dtype=torch.float32, device=dev)
    triton_decode._combine_kernel[(b * hq,)](part_o, part_m, part_l, out, lse, parts, D=d,
                                             BLOCK_S=max(16, triton.next_power_of_2(parts)), BLOCK_D=block_d)
    return out, lse, s_fp


@grid_decode.register_fake
def _(q_enc, q_fp, kc, ks, grid, vc, vs, kf, vf, mask, bias, live, softcap, noise, key_norm, bits_v, code_bits):
    b, hq, d = q_fp.shape
    return (q_fp.new_empty(b, hq, d, dtype=torch.float32), q_fp.new_empty(b, hq, dtype=torch.float32),
            q_fp.new_empty(b, hq, kf.shape[2], dtype=torch.float32))
