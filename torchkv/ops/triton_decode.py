"""Split-K decode attention over KIVI's stored form, as Triton kernels, beside its eager reference.

The stored form (`quantize.uniform` + planar `pack.bits`): keys are b-bit codes per channel in groups of `Gk`
tokens, `k̂_td = c_td·Δ_{t/Gk,d} + m_{t/Gk,d}`; values are b-bit codes per token in groups of `Gv` channels,
`v̂_td = c_td·Δ_{t,d/Gv} + m_{t,d/Gv}`; codes are planar-packed (`ops.pack`: channel `d = i·M + j` is byte j of
plane i, at bit offset `b·i`). Full-precision tokens (sinks, window, the new one) follow the encoded ones.

`kivi_decode` computes `softmax(q·[k̂; k_fp]ᵀ)·[v̂; v_fp]` for one new query per row in two kernels:

- `_split_kernel`, grid `(B·H, S + 1)`: program (b·h, s) serves all `g = Hq/H` query heads of KV head h (GQA
  inside the program, so each code is read once), over split s of the encoded tokens; the last split is the
  full-precision tokens. It unpacks the codes in registers, applies the mask, the live-token bound and soft-capping,
  and keeps an online softmax: it writes its running max m, sum l and unnormalized output `[g, D]`.
- `_combine_kernel`, grid `(B·Hq,)`: the log-sum-exp combine of the S + 1 partials.

No `[B, H, T, D]` key or value is formed. The op is registered with `torch.library.custom_op`, so
`torch.compile` keeps it as one opaque call in its graph and CUDA graphs capture it (nothing in it syncs).
On CPU tensors the kernels run only under Triton's interpreter (`TRITON_INTERPRET=1`), which tests use.
"""

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the Inductor path serves every device without Triton
    triton = None

# Launch settings, from a sweep of their combinations on an H100 (torch 2.11, `benchmarks/kernel_sweep.py`,
# benchmarks/results/gpu/kernel_sweep_run3.json): one layer at 1B b16 x 16K and 8B b8 x 32K, ms per call.
#: programs to aim for across the splits (2048: 0.66 ms against 0.84 with 512 at 1B, one factor at a time), and the
#: fewest token blocks of a split (each split writes a partial output [g, D] that the combine reads back)
TARGET_PROGRAMS = 2048
MIN_SPLIT_BLOCKS = 4
#: tokens a program reads per step of its loop (a divisor or a multiple of the key token group folds each group's
#: scales into the query; 32: 0.40 and 0.60 ms, 64: 0.36 and 0.85, 128: 0.40 and 1.03, at 2 or 4 warps)
BLOCK_T = 32
#: the dots' operands; None: in the model's dtype for 16-bit models, as SDPA over their cache computes (0.40 and
#: 0.60 ms, max error 6e-4), and float32 at "tf32x3" (about float32's error) for float32 models; or float32 at this
#: `input_precision` ("tf32": 0.36 and 0.66 ms, max error 1.5e-4)
PRECISION = None
#: warps per program (2: 0.40 and 0.60 ms; 4: 0.37 and 0.94; 8: 0.70 and 0.93)
NUM_WARPS = 2
#: software pipeline stages of the token loop (2: 0.75 ms against 0.83 with 3 at 1B; equal at 8B)
NUM_STAGES = 2


def kivi_decode_reference(
    q_enc, q_fp, kc, ks, kz, vc, vs, vz, kf, vf, mask, bias, live, softcap: float, bits_k: int, bits_v: int
):
    """Eager reference of `kivi_decode` (dequantizes the whole history; for tests only). Shapes as `kivi_decode`."""
    from torchkv.ops.pack import unpack_bits
    from torchkv.ops.quantize import dequantize

    d, te = q_fp.shape[-1], kc.shape[2]
    k_hat = dequantize(unpack_bits(kc, bits_k, d), ks, kz, bits_k, -2, te // ks.shape[2])
    v_hat = dequantize(unpack_bits(vc, bits_v, d), vs, vz, bits_v, -1, d // vs.shape[-1])
    return reference_attention(q_enc, q_fp, k_hat, v_hat, kf, vf, mask, bias, live, softcap)


def reference_attention(q_enc, q_fp, k_hat, v_hat, kf, vf, mask, bias, live, softcap: float):
    """The decode kernels' result from rebuilt encoded keys and values `k_hat`, `v_hat` `[B, H, TE, D]` (the
    references' common part; other arguments and the returns as `kivi_decode`)."""
    b, hq, d = q_fp.shape
    h, te = k_hat.shape[1], k_hat.shape[2]
    g = hq // h
    s_enc = torch.einsum("bhgd,bhtd->bhgt", q_enc.view(b, h, g, d), k_hat)
    if bias is not None:  # one per query head, or one per query head and encoded token
        s_enc = s_enc + bias.view(b, h, g, -1)
    s_fp = torch.einsum("bhgd,bhtd->bhgt", q_fp.view(b, h, g, d), kf.float())
    scores = torch.cat([s_enc, s_fp], -1)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    index = torch.arange(scores.shape[-1], device=scores.device)
    allowed = ((index < (te if live is None else live)) | (index >= te))[None, None, None]
    if mask is not None:
        allowed = allowed & mask.view(mask.shape[0], 1, 1, -1)
    scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse[..., None])
    out = p[..., :te] @ v_hat + p[..., te:] @ vf.float()
    return out.reshape(b, hq, d), lse.reshape(b, hq), scores[..., te:].reshape(b, hq, -1)


if triton is not None:

    @triton.jit
    def _tanh(x):
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _online(s, m, l, acc, v, DOT: tl.constexpr, PRECISION: tl.constexpr):
        """One block of the online softmax: scores s [G, T] (fp32), values v [T, DP]; the dot's operands in DOT."""
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PRECISION)
        return m_new, l, acc

    @triton.jit
    def _planar(BITS: tl.constexpr, M, M_PAD: tl.constexpr, D):
        """The channel `d` [P·M_PAD] held at each column of unpacked planar codes (plane i, byte j: d = i·M + j),
        and whether the column holds one (j < M, d < D)."""
        c = tl.arange(0, (8 // BITS) * M_PAD)
        j = c % M_PAD
        d = (c // M_PAD) * M + j
        return d, (j < M) & (d < D)

    @triton.jit
    def _codes(ptr, rows, tmask, M, BITS: tl.constexpr, M_PAD: tl.constexpr, BLOCK: tl.constexpr):
        """The b-bit codes of `rows` [BLOCK] of planar-packed bytes (M per row, read contiguously), unpacked in
        registers: [BLOCK, P·M_PAD] int32, plane by plane (the column order of `_planar`)."""
        j = tl.arange(0, M_PAD)
        packed = tl.load(ptr + rows[:, None] * M + j[None, :], mask=tmask[:, None] & (j < M)[None, :], other=0)
        shifts = tl.arange(0, 8 // BITS) * BITS
        planes = (packed.to(tl.int32)[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
        return tl.reshape(planes, (BLOCK, (8 // BITS) * M_PAD))

    @triton.jit
    def _scored(s, t, tmask, mask, mask_at, softcap, SOFTCAP: tl.constexpr, HAS_MASK: tl.constexpr):
        """Scores s [G, BLOCK] of tokens `t`, soft-capped, -inf where masked out (`mask[mask_at + t]` == 0) or
        past the end (`tmask`)."""
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        keep = tmask
        if HAS_MASK:
            keep = keep & (tl.load(mask + mask_at + t, mask=tmask, other=0) != 0)
        return tl.where(keep[None, :], s, float("-inf"))

    @triton.jit
    def _encoded_scores(q, codes, ks, kz, extra, bh, t0, t, tmask, dk, dk_ok, TE,
                        D: tl.constexpr, GK: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
        """q · k [BLOCK_G, BLOCK] of one block of per-channel key codes [BLOCK, P·MK_PAD] (fp32), plus `extra`.
        A block of GROUPS whole token groups folds each group's scale and zero into the query; any other block
        dequantizes its keys."""
        if GROUPS > 0:
            ob = tl.arange(0, BLOCK)
            s = tl.zeros([BLOCK_G, BLOCK], tl.float32)
            for i in tl.static_range(GROUPS):
                group = t0 // GK + i
                meta = (bh * (TE // GK) + group) * D + dk
                ok = dk_ok & (group * GK + 0 * dk < TE)  # the last block may pass the last group
                scale = tl.load(ks + meta, mask=ok, other=0.0).to(tl.float32)
                zero = tl.load(kz + meta, mask=ok, other=0.0).to(tl.float32)
                part = tl.dot((q * scale[None, :]).to(DOT), tl.trans(codes.to(DOT)),
                              input_precision=PRECISION) + (tl.sum(q * zero[None, :], 1) + extra)[:, None]
                if GROUPS == 1:
                    s = part
                else:
                    s = tl.where((ob // GK == i)[None, :], part, s)
        else:
            meta = (bh * (TE // GK) + t // GK)[:, None] * D + dk[None, :]
            both = tmask[:, None] & dk_ok[None, :]
            k = codes * tl.load(ks + meta, mask=both, other=0.0).to(tl.float32) + \
                tl.load(kz + meta, mask=both, other=0.0).to(tl.float32)
            s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PRECISION) + extra[:, None]
        return s

    @triton.jit
    def _encoded_values(vc, vs, vz, row, tmask, dv, dv_ok, MV, D: tl.constexpr, GV: tl.constexpr,
                        BITS_V: tl.constexpr, MV_PAD: tl.constexpr, BLOCK: tl.constexpr):
        """Values [BLOCK, P·MV_PAD] (fp32, planar column order) of token `row`s, dequantized per token group."""
        meta = row[:, None] * (D // GV) + (dv // GV)[None, :]
        both = tmask[:, None] & dv_ok[None, :]
        return _codes(vc, row, tmask, MV, BITS_V, MV_PAD, BLOCK).to(tl.float32) * \
            tl.load(vs + meta, mask=both, other=0.0).to(tl.float32) + \
            tl.load(vz + meta, mask=both, other=0.0).to(tl.float32)

    @triton.jit
    def _full_precision_part(q_fp, kf, vf, s_fp, mask, mrow, softcap, m, l, acc, bh, hq, gmask, dv, dv_ok, TE, F,
                             D: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
        """The online softmax over the F full-precision tokens, which follow the TE encoded ones; their scores are
        also written to `s_fp` [B·Hq, F] (what window policies read)."""
        ob = tl.arange(0, BLOCK)
        od = tl.arange(0, BLOCK_D)
        q = tl.load(q_fp + hq[:, None] * D + od[None, :], mask=gmask[:, None] & (od < D)[None, :], other=0.0)
        for t0 in range(0, F, BLOCK):
            t = t0 + ob
            tmask = t < F
            rows = (bh * F + t)[:, None] * D
            k = tl.load(kf + rows + od[None, :], mask=tmask[:, None] & (od < D)[None, :], other=0.0)
            s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PRECISION)
            s = _scored(s, t, tmask, mask, mrow + TE, softcap, SOFTCAP, HAS_MASK)
            tl.store(s_fp + hq[:, None] * F + t[None, :], s, mask=gmask[:, None] & tmask[None, :])
            v = tl.load(vf + rows + dv[None, :], mask=tmask[:, None] & dv_ok[None, :], other=0.0)
            m, l, acc = _online(s, m, l, acc, v, DOT, PRECISION)
        return m, l, acc

    @triton.jit
    def _split_bounds(split, SPLIT, TE, bias, hq, gmask, live, BLOCK_G: tl.constexpr, HEAD_BIAS: tl.constexpr,
                      HAS_LIVE: tl.constexpr):
        """Encoded tokens [start, end) of `split` (none past the live count), and the bias of the query heads `hq`
        where it is one per head."""
        extra = tl.zeros([BLOCK_G], tl.float32)
        if HEAD_BIAS:
            extra = tl.load(bias + hq, mask=gmask, other=0.0)
        end = TE
        if HAS_LIVE:
            end = tl.minimum(end, tl.load(live).to(tl.int32))
        start = split * SPLIT
        return start, tl.minimum(end, start + SPLIT), extra

    @triton.jit
    def _token_bias(s, bias, hq, t, gmask, tmask, TE, TOKEN_BIAS: tl.constexpr):
        """Scores s [G, BLOCK] of encoded tokens `t` plus the bias of each (query head, token) where the bias is one
        per token (`bias` [B·Hq, TE])."""
        if TOKEN_BIAS:
            s = s + tl.load(bias + hq[:, None] * TE + t[None, :], mask=gmask[:, None] & tmask[None, :], other=0.0)
        return s

    @triton.jit
    def _store_partial(part_o, part_m, part_l, m, l, acc, hq, gmask, split, NSPLIT, dv, dv_ok, D: tl.constexpr):
        """A split's running max, sum and unnormalized output `[G, D]` (planar columns `dv`), for the combine."""
        at = hq * (NSPLIT + 1) + split
        tl.store(part_m + at, m, mask=gmask)
        tl.store(part_l + at, l, mask=gmask)
        tl.store(part_o + at[:, None] * D + dv[None, :], acc, mask=gmask[:, None] & dv_ok[None, :])

    @triton.jit
    def _split_kernel(
        q_enc, q_fp, kc, ks, kz, vc, vs, vz, kf, vf, mask, bias, live,
        part_o, part_m, part_l, s_fp,
        H, TE, F, MK, MV, SPLIT, NSPLIT, mask_rows, mask_cols, softcap,
        G: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
        BITS_K: tl.constexpr, BITS_V: tl.constexpr, MK_PAD: tl.constexpr, MV_PAD: tl.constexpr,
        HAS_MASK: tl.constexpr, HEAD_BIAS: tl.constexpr, TOKEN_BIAS: tl.constexpr, HAS_LIVE: tl.constexpr,
        SOFTCAP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr,
        DOT: tl.constexpr, PRECISION: tl.constexpr,
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
            dk, dk_ok = _planar(BITS_K, MK, MK_PAD, D)
            q = tl.load(q_enc + hq[:, None] * D + dk[None, :], mask=gmask[:, None] & dk_ok[None, :], other=0.0)
            start, end, extra = _split_bounds(split, SPLIT, TE, bias, hq, gmask, live, BLOCK_G, HEAD_BIAS, HAS_LIVE)
            for t0 in range(start, end, BLOCK):
                t = t0 + ob
                tmask = t < end
                row = bh * TE + t  # token row of the [B·H, TE, ...] tensors
                codes = _codes(kc, row, tmask, MK, BITS_K, MK_PAD, BLOCK).to(tl.float32)
                s = _encoded_scores(q, codes, ks, kz, extra, bh, t0, t, tmask, dk, dk_ok, TE,
                                    D, GK, GROUPS, BLOCK_G, BLOCK, DOT, PRECISION)
                s = _token_bias(s, bias, hq, t, gmask, tmask, TE, TOKEN_BIAS)
                s = _scored(s, t, tmask, mask, mrow, softcap, SOFTCAP, HAS_MASK)
                v = _encoded_values(vc, vs, vz, row, tmask, dv, dv_ok, MV, D, GV, BITS_V, MV_PAD, BLOCK)
                m, l, acc = _online(s, m, l, acc, v, DOT, PRECISION)
        else:
            m, l, acc = _full_precision_part(q_fp, kf, vf, s_fp, mask, mrow, softcap, m, l, acc, bh, hq, gmask, dv,
                                             dv_ok, TE, F, D, HAS_MASK, SOFTCAP, BLOCK_D, BLOCK, DOT, PRECISION)
        _store_partial(part_o, part_m, part_l, m, l, acc, hq, gmask, split, NSPLIT, dv, dv_ok, D)

    @triton.jit
    def _combine_kernel(part_o, part_m, part_l, out, lse, PARTS,
                        D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)  # one query head of one batch row
        os_ = tl.arange(0, BLOCK_S)
        od = tl.arange(0, BLOCK_D)
        smask = os_ < PARTS
        m = tl.load(part_m + row * PARTS + os_, mask=smask, other=float("-inf"))
        l = tl.load(part_l + row * PARTS + os_, mask=smask, other=0.0)
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(m - top)
        total = tl.sum(w * l, 0)
        o = tl.load(part_o + (row * PARTS + os_)[:, None] * D + od[None, :],
                    mask=smask[:, None] & (od < D)[None, :], other=0.0)
        o = tl.sum(o * w[:, None], 0) / total
        tl.store(out + row * D + od, o, mask=od < D)
        tl.store(lse + row, top + tl.log(total))


def runs_on(device: torch.device) -> bool:
    """Decode attention on `device` runs these kernels (CUDA, with Triton installed)."""
    return triton is not None and device.type == "cuda"


def _splits(rows: int, tokens: int) -> tuple[int, int]:
    """(tokens per split, number of splits) for `rows` = B·H programs per split over `tokens` encoded tokens:
    enough splits for about `TARGET_PROGRAMS` programs, each a whole number of blocks, at least `MIN_SPLIT_BLOCKS`."""
    blocks = max(1, -(-tokens // BLOCK_T))
    wanted = min(max(1, blocks // MIN_SPLIT_BLOCKS), max(1, -(-TARGET_PROGRAMS // rows)))
    per = -(-blocks // wanted) * BLOCK_T
    return per, max(1, -(-tokens // per))


def _groups(gk: int) -> int:
    """Key token groups whose scales fold into the query per block of `BLOCK_T` tokens; 0 where blocks straddle
    groups (the block's keys are then dequantized before the dot)."""
    if gk % BLOCK_T == 0:
        return 1
    return BLOCK_T // gk if BLOCK_T % gk == 0 else 0


def bias_flags(bias: torch.Tensor | None, b: int, hq: int, te: int) -> dict:
    """The kernels' flags for a score bias: one per query head `[B, Hq]`, or per query head and encoded token
    `[B, Hq, TE]`. Any other shape is refused: the kernels index the bias by those extents alone."""
    if bias is not None and tuple(bias.shape) not in ((b, hq), (b, hq, te)):
        raise ValueError(f"a score bias must be [B, Hq] = [{b}, {hq}] or [B, Hq, TE] = [{b}, {hq}, {te}] (one per "
                         f"encoded token), not {list(bias.shape)}")
    return {"HEAD_BIAS": bias is not None and bias.dim() == 2, "TOKEN_BIAS": bias is not None and bias.dim() == 3}


def _dot(dtype: torch.dtype) -> dict:
    """The dots' operand dtype and input precision for a model of `dtype` (`PRECISION`)."""
    if PRECISION is None and dtype in (torch.bfloat16, torch.float16):
        return {"DOT": tl.bfloat16 if dtype == torch.bfloat16 else tl.float16, "PRECISION": "ieee"}
    return {"DOT": tl.float32, "PRECISION": PRECISION or "tf32x3"}


@torch.library.custom_op("torchkv::kivi_decode", mutates_args=())
def kivi_decode(
    q_enc: torch.Tensor, q_fp: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor, kz: torch.Tensor,
    vc: torch.Tensor, vs: torch.Tensor, vz: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor,
    mask: torch.Tensor | None, bias: torch.Tensor | None, live: torch.Tensor | None, softcap: float, bits_k: int,
    bits_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode attention of one query per row over KIVI-coded and full-precision tokens.

    Args:
        q_enc: [B, Hq, D] float32, the (scaled) query as the encoded keys read it; q_fp: the same for the
            full-precision keys. Query head i reads KV head i // (Hq/H).
        kc: [B, H, TE, MK] uint8 planar key codes; ks, kz: [B, H, TE/Gk, D] scale and zero point per channel.
        vc: [B, H, TE, MV] uint8 planar value codes; vs, vz: [B, H, TE, D/Gv] per channel group.
        kf, vf: [B, H, F, D] the full-precision tokens (sinks, window, new), after the encoded ones.
        mask: [B or 1, TE + F] bool, True where a token is attended; None: all.
        bias: float32 added to the encoded tokens' scores (key transforms' offsets): [B, Hq] one per query head,
            [B, Hq, TE] one per query head and token (a centre turned to each token's position); or None.
        live: 0-d int64 tensor, encoded tokens held (the rest are not read); None: all TE.
        softcap: the model's attention soft-capping `c·tanh(s/c)`, 0 for none.

    Returns:
        out [B, Hq, D] float32; lse [B, Hq] the log-sum-exp of the scores; s_fp [B, Hq, F] the
        full-precision tokens' scores, -inf where masked (their probabilities are `exp(s_fp - lse)`).
    """
    b, hq, d = q_fp.shape
    h, te, mk = kc.shape[1:]
    f, mv = kf.shape[2], vc.shape[-1]
    g = hq // h
    per, nsplit = _splits(b * h, te)
    parts = nsplit + 1
    dev = q_fp.device
    part_o = torch.empty(b * hq * parts, d, dtype=torch.float32, device=dev)
    part_m = torch.empty(b * hq * parts, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    s_fp = torch.empty(b, hq, f, dtype=torch.float32, device=dev)
    block_d = max(16, triton.next_power_of_2(d))
    unread = part_m  # stands for an absent mask, bias or live count, which the kernel then never reads
    _split_kernel[(b * h, parts)](
        q_enc.contiguous(), q_fp.contiguous(), kc.contiguous(), ks.contiguous(), kz.contiguous(), vc.contiguous(),
        vs.contiguous(), vz.contiguous(), kf.contiguous(), vf.contiguous(),
        unread if mask is None else mask.contiguous().view(torch.uint8), unread if bias is None else bias.contiguous(),
        unread if live is None else live, part_o, part_m, part_l, s_fp,
        h, te, f, mk, mv,
        per, nsplit, 1 if mask is None else mask.shape[0], te + f, float(softcap),
        G=g, D=d, GK=te // ks.shape[2], GV=d // vs.shape[-1], BITS_K=bits_k, BITS_V=bits_v,
        MK_PAD=triton.next_power_of_2(mk), MV_PAD=triton.next_power_of_2(mv),
        HAS_MASK=mask is not None, **bias_flags(bias, b, hq, te), HAS_LIVE=live is not None, SOFTCAP=bool(softcap),
        BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=block_d, BLOCK=BLOCK_T, GROUPS=_groups(te // ks.shape[2]),
        **_dot(kf.dtype),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    out = torch.empty(b, hq, d, dtype=torch.float32, device=dev)
    lse = torch.empty(b, hq, dtype=torch.float32, device=dev)
    _combine_kernel[(b * hq,)](part_o, part_m, part_l, out, lse, parts, D=d,
                               BLOCK_S=max(16, triton.next_power_of_2(parts)), BLOCK_D=block_d)
    return out, lse, s_fp


@kivi_decode.register_fake
def _(q_enc, q_fp, kc, ks, kz, vc, vs, vz, kf, vf, mask, bias, live, softcap, bits_k, bits_v):
    b, hq, d = q_fp.shape
    return (q_fp.new_empty(b, hq, d, dtype=torch.float32), q_fp.new_empty(b, hq, dtype=torch.float32),
            q_fp.new_empty(b, hq, kf.shape[2], dtype=torch.float32))
