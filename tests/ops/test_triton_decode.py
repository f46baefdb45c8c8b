"""The Triton split-K decode kernels over KIVI's stored form and over grid-coded keys (frontier's) equal their eager
references and the Inductor path.

On a machine without a GPU the kernels run on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`, set by
conftest before Triton is imported), in float32 and float16 (the interpreter has no bfloat16)."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import torchkv
import torchkv.transforms as T
from torchkv.models import cache_argument
from torchkv.ops import triton_decode, triton_grid_decode
from torchkv.pipeline import LayerState
from torchkv.testing import rope_tables, tiny_model

pytestmark = pytest.mark.skipif(triton_decode.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: the full-precision tokens' dtypes (the interpreter has no bfloat16)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _pipeline(bits: int, key_group: int, value_group: int, compile: bool | str = "auto") -> torchkv.KVPipeline:
    return torchkv.KVPipeline(
        keys=[T.quantize(bits=bits, axis="channel", group=key_group), T.pack()],
        values=[T.quantize(bits=bits, axis="token", group=value_group), T.pack()],
        compile=compile,
    )


class _Launches:
    """A kernel whose launches are counted."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def _tolerance(dtype: torch.dtype) -> dict:
    """The kernel's agreement with float32 arithmetic: about float32's error for float32 models (tf32x3 dots), and
    within 16-bit rounding (relative 2^-11 per operand) for 16-bit models, whose dots take operands in their dtype."""
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    return dict(atol=tol, rtol=tol)


@st.composite
def cases(draw):
    """A history of encoded chunks and full-precision tokens, with left padding, a live bound and a window rule."""
    bits = draw(st.sampled_from([1, 2, 4, 8]))
    dim = draw(st.sampled_from([32, 64, 80]))
    value_group = draw(st.sampled_from([g for g in (16, 32) if dim % g == 0]))
    key_group = draw(st.sampled_from([8, 32]))
    batch, heads, ratio = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 8))
    chunks = draw(st.integers(1, 4))
    fp = draw(st.integers(1, 40))
    return dict(bits=bits, dim=dim, value_group=value_group, key_group=key_group, batch=batch, heads=heads,
                ratio=ratio, chunks=chunks, fp=fp, live=draw(st.integers(0, chunks)), pad=draw(st.integers(0, 20)),
                window=draw(st.none() | st.integers(8, 60)), softcap=draw(st.sampled_from([0.0, 20.0])),
                dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 99)))


def _bias(c, q: torch.Tensor, tokens: int, per_token: bool) -> torch.Tensor:
    """A score bias: one per query head `[B, Hq]`, or one per query head and encoded token `[B, Hq, tokens]` (a turned
    centre's offsets)."""
    b, hq = q.shape[:2]
    g = torch.Generator().manual_seed(c["seed"] + 1)
    return (torch.randn(b, hq, *([tokens] if per_token else []), generator=g) * 0.5).to(DEVICE)


def _history_mask(c, tokens: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention mask `[B, tokens + fp]` of a case (row 0 left-padded, an optional sliding window, the new token
    attending to itself) and its live count of encoded tokens."""
    n = tokens + c["fp"]
    index = torch.arange(n)
    mask = (index[None] >= torch.tensor([c["pad"], 0][: c["batch"]])[:, None])  # row 0 left-padded
    if c["window"] is not None:  # a sliding window over the newest tokens
        mask = mask & (index >= n - c["window"])[None]
    mask[:, -1] = True  # the new token attends to itself
    return mask, torch.tensor(c["live"] * chunk)


def _inputs(c):
    """The case's pipeline, its stored history (encoded eagerly: the kernels, not the encoder, are the subject, and a
    compiled encoder would compile for each drawn shape) and the step's inputs."""
    g = torch.Generator().manual_seed(c["seed"])
    pipe, encoder = (_pipeline(c["bits"], c["key_group"], c["value_group"], compile=x) for x in ("auto", False))
    b, h, d = c["batch"], c["heads"], c["dim"]
    tokens = c["chunks"] * pipe.chunk
    k = torch.randn(b, h, tokens, d, generator=g) * 2 + 0.5
    v = torch.randn(b, h, tokens, d, generator=g)
    state = encoder.encode_chunk(k, v)
    q = torch.randn(b, h * c["ratio"], 1, d, generator=g) * d**-0.5
    kf = (torch.randn(b, h, c["fp"], d, generator=g) * 2).to(c["dtype"])
    vf = torch.randn(b, h, c["fp"], d, generator=g).to(c["dtype"])
    mask, live = _history_mask(c, tokens, pipe.chunk)
    state = {n: t.to(DEVICE) for n, t in state.items()}
    return pipe, state, *(t.to(DEVICE) for t in (q, kf, vf, mask, live))


@settings(max_examples=12)  # the interpreter runs each program in NumPy: about a second an example
@given(c=cases(), token_bias=st.booleans())
def test_kernel_equals_eager_reference(c, token_bias):
    pipe, s, q, kf, vf, mask, live = _inputs(c)
    b, hq, _, d = q.shape
    q = q.reshape(b, hq, d)
    args = (q, q, s["k.out"], s["k.0.scale"], s["k.0.zero"], s["v.out"], s["v.0.scale"], s["v.0.zero"], kf, vf, mask,
            _bias(c, q, c["chunks"] * pipe.chunk, token_bias), live, c["softcap"], c["bits"], c["bits"])
    expected = triton_decode.kivi_decode_reference(*args)
    got = triton_decode.kivi_decode(*args)
    for name, x, y in zip(("out", "lse", "s_fp"), got, expected):
        torch.testing.assert_close(x, y, **_tolerance(c["dtype"]), msg=name)


@settings(max_examples=8)
@given(c=cases())
def test_pipeline_kernel_path_equals_the_inductor_path(c):
    """`Codec.attend` through the kernel gives what it gives reading the packed codes with Inductor's
    reductions (the CPU path), fp-token attention included (what window policies read)."""
    pipe, s, q, kf, vf, mask, live = _inputs(c)
    encoded = {n: t.unflatten(2, (c["chunks"], -1)) for n, t in s.items()}
    softcap = c["softcap"] or None
    index = torch.arange(mask.shape[1], device=DEVICE)
    live_mask = mask & ((index < live) | (index >= c["chunks"] * pipe.chunk))[None]
    args = (q.float(), encoded, kf, vf, live_mask[:, None, None], softcap, LayerState({}, {}, {}))
    with pytest.MonkeyPatch.context() as patch:  # a function-scoped fixture would outlive hypothesis' examples
        patch.setattr(triton_decode, "runs_on", lambda device: False)
        expected = pipe.codec.attend(*args)
        patch.setattr(triton_decode, "runs_on", lambda device: True)
        assert pipe.kernel_refusal(c["dim"]) is None
        got = pipe.codec.attend(*args, live=live)
    torch.testing.assert_close(got[0], expected[0], **_tolerance(c["dtype"]))
    torch.testing.assert_close(got[1], expected[1], **(_tolerance(c["dtype"]) if c["dtype"] != torch.float32
                                                       else dict(atol=1e-5, rtol=1e-4)))


@pytest.mark.parametrize("masked", [True, False])
def test_many_splits_combine(masked):
    """A history long enough for several splits per row (the log-sum-exp combine of many partials), with a mask and a
    bias per token (read at each split's own tokens), or with no mask and no bias (arguments the kernel then never
    reads)."""
    c = dict(bits=2, dim=64, value_group=32, key_group=32, batch=1, heads=1, ratio=4, chunks=40, fp=3, live=37,
             pad=5, window=None, softcap=0.0, dtype=torch.float32, seed=3)
    pipe, s, q, kf, vf, mask, live = _inputs(c)
    assert triton_decode._splits(1, 40 * 32)[1] > 8
    q = q.reshape(1, 4, 64)
    args = (q, q, s["k.out"], s["k.0.scale"], s["k.0.zero"], s["v.out"], s["v.0.scale"], s["v.0.zero"], kf, vf,
            mask if masked else None, _bias(c, q, 40 * 32, per_token=True) if masked else None, live, 0.0, 2, 2)
    for x, y in zip(triton_decode.kivi_decode(*args), triton_decode.kivi_decode_reference(*args)):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_a_bias_of_another_shape_is_refused():
    """The kernels index a bias by [B, Hq] or [B, Hq, TE] alone: a bias over other tokens (here one token short) is
    refused, naming the shapes it may have, instead of read out of its bounds."""
    c = dict(bits=2, dim=64, value_group=32, key_group=32, batch=1, heads=1, ratio=4, chunks=2, fp=3, live=2,
             pad=0, window=None, softcap=0.0, dtype=torch.float32, seed=3)
    pipe, s, q, kf, vf, mask, live = _inputs(c)
    q = q.reshape(1, 4, 64)
    bias = _bias(c, q, 2 * 32, per_token=True)[..., 1:]
    args = (q, q, s["k.out"], s["k.0.scale"], s["k.0.zero"], s["v.out"], s["v.0.scale"], s["v.0.zero"], kf, vf,
            mask, bias, live, 0.0, 2, 2)
    with pytest.raises(ValueError, match=r"\[B, Hq, TE\] = \[1, 4, 64\]"):
        triton_decode.kivi_decode(*args)


@st.composite
def grid_cases(draw):
    """A frontier-like pipeline (optionally centred by a centre turned to each position, optionally balanced HIGGS
    keys on a 256-, 128-, 64- or 32-point grid, Hadamard-rotated symmetric per-token values) over a history as in
    `cases`."""
    c = draw(cases())
    return {**c, "dim": draw(st.sampled_from([32, 64, 80])), "key_bits": draw(st.sampled_from([1, 2, 2.5, 3, 3.5, 4])),
            "span": draw(st.sampled_from(["head", "token"])), "balance": draw(st.booleans()),
            "key_meta": draw(st.sampled_from(["float16", "float32", "float8_e5m2", "float8_e4m3fn"])),
            "value_meta": draw(st.sampled_from(["float16", "float8_e5m2", "float8_e4m3fn"])),
            "tiny": c["dtype"] == torch.float32 and draw(st.booleans()),  # 16-bit tokens this small are subnormal
            "score_correction": draw(st.booleans())}


def _grid_pipeline(c, compile: bool | str = "auto") -> torchkv.KVPipeline:
    dim = {1: 8, 2: 4, 2.5: 2, 3: 2, 3.5: 2, 4: 2}[c["key_bits"]]  # 8-bit codes, and 5-, 6- and 7-bit ones in words
    higgs = T.quantize("higgs", bits=c["key_bits"], dim=dim, span=c["span"], scale_dtype=c["key_meta"],
                       score_correction=c.get("score_correction", False))
    values = T.quantize(bits=c["bits"], axis="token", group=None, symmetric=True, step="gaussian",
                        meta_dtype=c["value_meta"])
    keys = [*([T.predict("rotary_center")] if c.get("rotary_center") else []),
            *([T.project("balance")] if c["balance"] else []), higgs, T.pack()]
    # frontier's chunk of 32 tokens: per-token quantizers alone would make each token a chunk of its own
    return torchkv.KVPipeline(keys=keys, values=[T.rotate("hadamard"), values, T.pack()], chunk=32, compile=compile)


def _grid_inputs(c):
    """As `_inputs`, for a `grid_cases` pipeline, and the encoded tokens' rotary tables; "tiny" keys and values have
    subnormal float8 metadata."""
    g = torch.Generator().manual_seed(c["seed"])
    pipe, encoder = _grid_pipeline(c), _grid_pipeline(c, compile=False)
    b, h, d, hq = c["batch"], c["heads"], c["dim"], c["heads"] * c["ratio"]
    tokens = c["chunks"] * pipe.chunk
    size = 1e-5 if c["tiny"] else 1.0
    k = (torch.randn(b, h, tokens, d, generator=g) * 2 + 0.5) * size
    v = torch.randn(b, h, tokens, d, generator=g) * size
    rope = rope_tables(b, tokens, d)
    prepared = encoder.prepare(k, v, inputs={"queries": torch.randn(b, hq, tokens, d, generator=g), **rope})
    state = encoder.encode_chunk(k, v, prepared=prepared, inputs=rope)
    q = torch.randn(b, hq, 1, d, generator=g) * d**-0.5
    kf = (torch.randn(b, h, c["fp"], d, generator=g) * 2 * size).to(c["dtype"])
    vf = (torch.randn(b, h, c["fp"], d, generator=g) * size).to(c["dtype"])
    mask, live = _history_mask(c, tokens, pipe.chunk)
    to = lambda tensors: {n: t.to(DEVICE) for n, t in tensors.items()}  # noqa: E731
    return pipe, to(state), to(prepared), to(rope), *(t.to(DEVICE) for t in (q, kf, vf, mask, live))


def _grid_args(pipe, s, q, kf, vf, mask, live, softcap, bias, noise: bool = False):
    """The kernel's arguments; with `noise`, a score-noise correction of each query head (its scale as
    `Codec.kernel_attend` gives it, half the grid's MSE times the query's squared norm)."""
    b, hq, _, d = q.shape
    higgs = pipe.keys.transforms[pipe.keys.reader]
    per_head = 0.5 * 0.1 * q.reshape(b, hq, d).float().square().sum(-1) if noise else None
    return (q.reshape(b, hq, d), q.reshape(b, hq, d), s["k.out"],
            s[f"k.{pipe.keys.reader}.scale"][..., 0], higgs.grid_on(q.device), s["v.out"],
            s[f"v.{pipe.values.reader}.scale"][..., 0], kf, vf,
            mask, bias, live, softcap, per_head, higgs.row_norm(kf.shape[1], d),
            pipe.values.transforms[1].config.bits, higgs.code_bits)


@settings(max_examples=8)  # the suite's time: grid cases share the KIVI cases' split, mask and combine code
@given(c=grid_cases(), token_bias=st.booleans())
def test_grid_kernel_equals_eager_reference(c, token_bias):
    pipe, s, _, _, q, kf, vf, mask, live = _grid_inputs(c)
    args = _grid_args(pipe, s, q, kf, vf, mask, live, c["softcap"], _bias(c, q, c["chunks"] * pipe.chunk, token_bias),
                      noise=c["score_correction"])
    expected = triton_grid_decode.grid_decode_reference(*args)
    got = triton_grid_decode.grid_decode(*args)
    for name, x, y in zip(("out", "lse", "s_fp"), got, expected):
        torch.testing.assert_close(x, y, **_tolerance(c["dtype"]), msg=name)


#: a long history of 6-bit key codes in words (the 3-bit grid), balanced, with float8 metadata and a padded row
LONG_GRID_CASE = dict(bits=2, dim=64, value_group=32, key_group=32, batch=1, heads=1, ratio=4, chunks=40, fp=3, live=37,
                      pad=5, window=None, softcap=0.0, dtype=torch.float32, seed=3, key_bits=3, span="head",
                      balance=True, key_meta="float8_e5m2", value_meta="float8_e5m2", tiny=False)


@settings(max_examples=8)
@given(c=grid_cases(), rotary_center=st.booleans())
@example(c={**LONG_GRID_CASE, "chunks": 3, "live": 3}, rotary_center=True)  # every encoded token live, keys not tiny
@example(c={**LONG_GRID_CASE, "chunks": 3, "key_bits": 2.5}, rotary_center=False)  # 5-bit codes take the kernel too
def test_pipeline_grid_kernel_path_equals_the_inductor_path(c, rotary_center):
    """`Codec.attend` of a frontier-like pipeline through the grid kernel (query balanced and rotated, a turned
    centre's offsets one per token, window values rotated into the codes' domain, the output rotated back) gives what
    the CPU path gives."""
    pipe, s, prepared, rope, q, kf, vf, mask, live = _grid_inputs({**c, "rotary_center": rotary_center})
    encoded = {n: t.unflatten(2, (c["chunks"], -1)) for n, t in s.items()}
    index = torch.arange(mask.shape[1], device=DEVICE)
    live_mask = mask & ((index < live) | (index >= c["chunks"] * pipe.chunk))[None]
    args = (q.float(), encoded, kf, vf, live_mask[:, None, None], c["softcap"] or None, LayerState({}, prepared, rope))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_decode, "runs_on", lambda device: False)
        expected = pipe.codec.attend(*args)
        patch.setattr(triton_decode, "runs_on", lambda device: True)
        assert pipe.codec.kernel(c["dim"]) == ("grid", None)
        got = pipe.codec.attend(*args, live=live)
    scale = 1e-5 if c["tiny"] else 1.0
    tol = _tolerance(c["dtype"])
    torch.testing.assert_close(got[0], expected[0], atol=tol["atol"] * scale, rtol=tol["rtol"])
    torch.testing.assert_close(got[1], expected[1], **(tol if c["dtype"] != torch.float32
                                                       else dict(atol=1e-5, rtol=1e-4)))


@pytest.mark.parametrize("key_bits", [2.5, 3, 3.5])
def test_grid_many_splits_combine(key_bits):
    """Many splits of 5-, 6- and 7-bit key codes packed in words (the 2.5-, 3- and 3.5-bit grids): the codes that
    straddle bytes read right, and a bias per token at each split's own tokens with a score-noise correction."""
    c = {**LONG_GRID_CASE, "key_bits": key_bits}
    pipe, s, _, _, q, kf, vf, mask, live = _grid_inputs(c)
    assert triton_decode._splits(1, 40 * 32)[1] > 8
    args = _grid_args(pipe, s, q, kf, vf, mask, live, 0.0, _bias(c, q, 40 * 32, per_token=True), noise=True)
    for x, y in zip(triton_grid_decode.grid_decode(*args), triton_grid_decode.grid_decode_reference(*args)):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("preset, capacity", [("kivi-2bit", None), ("kivi-2bit", 200),
                                              ("frontier-2bit:rotary_center=True", None)])
def test_a_model_decodes_through_the_kernel(preset, capacity, monkeypatch):
    """A padded batch on a tiny model with sinks: the kernel path (growing store or fixed-capacity buffers, one
    launch per row group) gives the logits of eager decode (`compile=False`) across window flushes; frontier's
    first layer at 4 bits (2-D grid) and its second at 2 (4-D grid), each through its own kernel launch, with keys
    centred by a centre turned to each position (the kernel adds its offsets per token, from the chunks' rotary
    tables of each padded row). Each row's window (44 and 41 tokens after the prompt's chunk, of at most 16 + 32)
    flushes once in the 9 decode steps."""
    model = tiny_model("llama").to(DEVICE)
    ids = torch.randint(3, 128, (2, 78), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    logits, launches = {}, _Launches(triton_decode._combine_kernel)
    monkeypatch.setattr(triton_decode, "_combine_kernel", launches)
    for kernel in (False, True):
        monkeypatch.setattr(triton_decode, "runs_on", lambda device, kernel=kernel: kernel)
        options = {"wide_layers": 1} if preset.startswith("frontier") else {}
        pipe = torchkv.KVPipeline.from_preset(preset, residual=16, sinks=2, compile=kernel, **options)  # or eager
        with torchkv.patched(model, pipe):
            cache = torchkv.new_cache(model, max_cache_len=capacity)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                                 **cache_argument(model, cache))
        logits[kernel] = torch.stack(out.logits)
        assert [int(s.n_encoded) for s in cache.layers[0].stores()] == [64, 64]  # each row's prompt chunk and flush
        groups = 2  # the two rows (pads 3 and 0, with sinks) are held in row groups of their own
        assert launches.count == (9 * model.config.num_hidden_layers * groups if kernel else 0)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)


def test_explain_names_the_kernel_or_why_not():
    assert "KIVI's layout" in torchkv.KVPipeline.from_preset("kivi-2bit").explain()
    assert "grid-coded keys" in torchkv.KVPipeline.from_preset("frontier-2bit").explain()
    assert "frontier's" in torchkv.KVPipeline.from_preset("frontier-2bit", values="higgs").explain()  # grid values
    assert "fused Triton encoder" not in torchkv.KVPipeline.from_preset("frontier-2bit").explain()
    assert "not the fused Triton encoder" in torchkv.KVPipeline.from_preset("frontier-2bit:query_metric=True").explain()


@pytest.mark.parametrize("block, dtype", [(64, torch.float32), (128, torch.float32), (8, torch.float32),
                                          (32, torch.float16)])
def test_launch_settings_keep_the_result(block, dtype, monkeypatch):
    """Blocks of several key token groups (each group's scales folded into the query), blocks that straddle groups
    (keys dequantized before the dot), and a 16-bit model, whose dots take operands in its dtype (as SDPA over its
    cache does)."""
    monkeypatch.setattr(triton_decode, "BLOCK_T", block)
    c = dict(bits=2, dim=64, value_group=32, key_group=32 if block != 8 else 12, batch=2, heads=2, ratio=4, chunks=7,
             fp=5, live=6, pad=5, window=None, softcap=0.0, dtype=dtype, seed=4)
    pipe, s, q, kf, vf, mask, live = _inputs(c)
    q = q.reshape(2, 8, 64)
    args = (q, q, s["k.out"], s["k.0.scale"], s["k.0.zero"], s["v.out"], s["v.0.scale"], s["v.0.zero"], kf, vf, mask,
            None, live, 0.0, 2, 2)
    assert triton_decode._groups(c["key_group"]) == {64: 2, 128: 4, 8: 0, 32: 1}[block]
    assert triton_decode._dot(dtype)["DOT"] == (triton_decode.tl.float16 if dtype == torch.float16 else
                                                triton_decode.tl.float32)
    for x, y in zip(triton_decode.kivi_decode(*args), triton_decode.kivi_decode_reference(*args)):
        torch.testing.assert_close(x, y, **_tolerance(dtype))
