"""Every built-in transform: round trip, chunk-concatenation invariant, compile == eager."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchkv.transforms as T
from torchkv import registry
from torchkv.pipeline import COMPILE_OPTIONS, Chain, LayerState
from torchkv.transforms import Context, ProjectionWeights

EXAMPLES = {
    ("rotate", "hadamard"): [{}, {"block": 16}],
    ("rotate", "pre_rope"): [{}],
    ("quantize", "uniform"): [
        {"bits": 2, "axis": "channel", "group": 8},
        {"bits": 4, "axis": "token", "group": 16, "symmetric": True},
        {"bits": 3, "axis": "token", "group": 32, "meta_dtype": "float32"},
        {"bits": 2, "axis": "token", "group": None, "symmetric": True, "step": "gaussian", "meta_dtype": "float8_e5m2"},
    ],
    ("quantize", "cast"): [{"dtype": "float16"}, {"dtype": "bfloat16"}],
    ("pack", "bits"): [{"bits": 3}, {"bits": 2}, {"bits": (8, 4, 2, 1)}],
    ("project", "query_subspace"): [{}],
    ("quantize", "squat"): [{"bits": 2, "group": 8}, {"bits": 3, "group": 32}],
    ("project", "svd"): [{"basis_dtype": "float32"}],
    ("project", "landmarks"): [{}],
    ("quantize", "schedule"): [{"bits": (8, 4, 2, 1), "group": 8}, {"bits": (4, 4), "group": 32}],
    ("quantize", "higgs"): [
        {},
        {"bits": 3, "span": "token"},
        {"bits": 4, "scale_dtype": "bfloat16"},
        {"bits": 2, "dim": 4, "span": "token", "scale_dtype": "float32"},
        {"bits": 1, "dim": 8, "scale_dtype": "float8_e5m2"},
    ],
    ("predict", "linear"): [{}, {"sources": ("keys", "previous"), "weight_dtype": "float32"}],
    ("predict", "delta"): [{}],
    ("predict", "center"): [{}],
    ("predict", "rotary_center"): [{}],
    ("project", "balance"): [{}],
    ("project", "weights"): [
        {"basis_dtype": "float32"},
        {"side": "v", "basis": "input"},
        {"outliers": 2, "basis_dtype": "float32"},
    ],
}
CASES = [(kind, name, cfg) for (kind, name), cfgs in EXAMPLES.items() for cfg in cfgs]


def test_every_builtin_transform_is_exercised():
    builtin = {key for key in registry.transforms() if registry.transform_class(*key).__module__.startswith("torchkv.")}
    assert builtin <= set(EXAMPLES), f"add examples for {builtin - set(EXAMPLES)}"


#: width of the layer input X the weight-derived transforms read (their keys and values are 3 heads x 64)
X_WIDTH = 96


def _model_inputs(b, t, d, seed=0):
    """Rotary cos/sin [B, T, D], the other reconstructions a predictor reads [B, 3, T, D], the layer input X,
    queries of 2 heads per KV head [B, 6, T, D] with per-channel scales."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(b, t, d // 2, generator=g) * 6.3
    angles = torch.cat([angles, angles], -1)
    previous, keys = torch.randn(2, b, 3, t, d, generator=g)
    x = torch.randn(b, t, X_WIDTH, generator=g)
    queries = torch.randn(b, 6, t, d, generator=g) * torch.rand(d, generator=g).exp()
    return {"cos": angles.cos(), "sin": angles.sin(), "previous": previous, "keys": keys, "x": x, "queries": queries}


def _tokens(tensor, sl):
    """The tokens `sl` of a model input (token axis 1 of [B, T, R], 2 of [B, H, T, D])."""
    return tensor[:, :, sl] if tensor.dim() == 4 else tensor[:, sl]


def _params(transform, d) -> dict:
    """Fitted parameters: a predictor's random linear map of its sources' 3 heads, or random projections from
    X to 3 heads for transforms fitted from weights."""
    if transform.fits_weights:
        g = torch.Generator().manual_seed(1)
        w_k, w_v = torch.randn(2, X_WIDTH, 3 * d, generator=g) / X_WIDTH**0.5
        transform.fit_weights(0, ProjectionWeights(w_k, w_v, torch.randn(3 * d, generator=g), None))
        return transform.layer_params(0)
    if not transform.needs_fit:
        return {}
    g = torch.Generator().manual_seed(1)
    transform.fit_layer(0, torch.randn(3 * d * len(transform.config.sources), 3 * d, generator=g) / 20,
                        torch.randn(3 * d, generator=g))
    return transform.layer_params(0)


def _upstream(transform, batch: int) -> dict:
    """What earlier transforms would have prepared. SQuat's corrections are zero here, so the generic
    bound is KIVI's; its bound against corrected values is tested in tests/ops/test_squat.py."""
    if "updates" in transform.reads_upstream:
        return {"updates": torch.zeros(batch, 3, 32, 32)}  # M_1 for D = 64, g = 32
    return {}


def _prepared(transform, x, inputs) -> dict:
    """What `prepare` gives a transform whose encoding reads it (the prompt's SVD basis, its channel medians,
    its query-balanced channel scales)."""
    if not {"basis", "center", "balance"} & transform.prepares:
        return {}
    return transform.prepare(x, Context(dim=x.shape[-1], inputs=inputs))


def _consistent(transform, x, ctx):
    """For a transform caching a function of X: the keys or values that X projects to, `[B, 3, T, D]`."""
    if transform.name != "weights":
        return x
    up = ctx.params["up"].float()
    out = ctx.inputs["x"] @ (ctx.params["down"].float() @ up if "down" in ctx.params else up)
    if "bias" in ctx.params:
        out = out + ctx.params["bias"]
    return out.unflatten(-1, (3, -1)).transpose(1, 2)


def _input(transform, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if transform.kind == "pack":
        widths = transform.config.bits
        high = 2 ** min(widths) if isinstance(widths, tuple) else 2**widths
        return torch.randint(0, high, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g)


def _tolerance(transform, x, state):
    """Largest allowed |decode(encode(x)) - x| per element."""
    if transform.kind == "quantize" and transform.name in ("uniform", "squat", "schedule"):
        dim = 3 if getattr(transform.config, "axis", "channel") == "token" else 2
        step = state["scale"].float().repeat_interleave(transform.config.group or x.shape[-1], dim=dim)
        if getattr(transform.config, "step", "range") == "gaussian":  # values beyond the outer levels clip to them
            step = torch.maximum(step, 2 * (x.abs() - (2**transform.config.bits - 1) / 2 * step))
        return step / 2 * (1 + 1e-5) + 1e-6
    if transform.kind == "quantize" and transform.name == "higgs":
        # per row, the nearest grid point is no farther than the one closest to 0: ‖x̂ − x‖ ≤ ‖x‖ + s·r0/√d
        r0 = transform.grid.norm(dim=-1).min()
        return state["scale"].float() * (1 + r0 / transform.config.dim**0.5) * 1.01 + 1e-6
    if transform.kind == "quantize":  # a cast: one rounding of the storage dtype
        return x.abs() * torch.finfo(getattr(torch, transform.config.dtype)).eps + 1e-6
    if transform.name == "svd":  # an orthogonal change of basis in float32
        return 1e-5 * (1 + x.abs().amax())
    if transform.name == "weights":  # float32 products; a float16 outlier channel rounds once
        return (2e-3 if transform.config.outliers else 2e-5) * (1 + x.abs().amax())
    return torch.full_like(x, 1e-5, dtype=torch.float32)


@pytest.mark.parametrize("kind,name,cfg", CASES, ids=lambda v: str(v))
@given(seed=st.integers(0, 10_000), chunks=st.integers(1, 3), batch=st.integers(1, 2))
def test_roundtrip_within_bound_and_concatenation(kind, name, cfg, seed, chunks, batch):
    t = registry.transform_class(kind, name)(**cfg)
    d, step = 64, 32
    shape = (batch, 3, step * chunks, d)
    x = _input(t, shape, seed)
    inputs = _model_inputs(batch, shape[2], d, seed)
    ctx = Context(dim=d, params=_params(t, d), inputs=inputs, upstream=_upstream(t, batch),
                  prepared=_prepared(t, x, inputs))
    x = _consistent(t, x, ctx)
    y, state = t.encode(x, ctx)
    xhat = t.decode(y, state, ctx)
    assert xhat.shape == x.shape
    assert torch.all((xhat.float() - x.float()).abs() <= _tolerance(t, x.float(), state))
    for tensor in (y, *state.values()):
        assert tensor.shape[0] == batch
    # the store's invariant: encoding chunk by chunk and concatenating along dim 2 decodes the same
    parts = []
    for i in range(chunks):
        sl = slice(i * step, (i + 1) * step)
        part_ctx = Context(
            dim=d, params=ctx.params, inputs={k: _tokens(v, sl) for k, v in inputs.items()}, upstream=ctx.upstream,
            prepared=ctx.prepared,
        )
        parts.append(t.encode(x[:, :, sl], part_ctx))
    y_cat = torch.cat([p[0] for p in parts], 2)
    state_cat = {k: torch.cat([p[1][k] for p in parts], 2) for k in state}
    torch.testing.assert_close(t.decode(y_cat, state_cat, ctx), xhat, rtol=0, atol=0)


def _with_pads(tensor: torch.Tensor, valid: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """`tensor` (token axis 1 of [B, T, R], 2 of [B, H, T, D]) with its pad tokens replaced by `fill`'s values."""
    pads = ~valid[:, None, :, None] if tensor.dim() == 4 else ~valid[:, :, None]
    return torch.where(pads, fill.expand_as(tensor).to(tensor.dtype), tensor)


@pytest.mark.parametrize("kind,name,cfg", CASES, ids=lambda v: str(v))
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), pads=st.lists(st.integers(0, 63), min_size=1, max_size=3),
       magnitude=st.sampled_from([0.0, 1e-3, 1.0, 1e3]))
def test_pad_values_change_nothing_of_the_real_tokens(kind, name, cfg, seed, pads, magnitude):
    """DESIGN: statistics (ranges, norms, scales, subspaces, bases, outliers) ignore padding. Left-padded rows
    whose pad tokens hold other values (in the keys or values and in every model input) give the same prepared
    state and the same reconstruction of every real token."""
    t = registry.transform_class(kind, name)(**cfg)
    batch, d, tokens = len(pads), 64, 64
    x = _input(t, (batch, 3, tokens, d), seed)
    valid = torch.arange(tokens)[None] >= torch.tensor(pads)[:, None]  # [B, T]: each row keeps a real token
    inputs = _model_inputs(batch, tokens, d, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ctx = Context(dim=d, params=_params(t, d), inputs=inputs, upstream=_upstream(t, batch), valid=valid)
    x = _consistent(t, x, ctx)

    def reconstruct(x, inputs):
        own = Context(dim=d, params=ctx.params, inputs=inputs, upstream=ctx.upstream, valid=valid)
        prepared = t.prepare(x, own) if t.needs_prepare else {}
        own = Context(dim=d, params=ctx.params, inputs=inputs, upstream=ctx.upstream, valid=valid, prepared=prepared)
        y, state = t.encode(x, own)
        return prepared, t.decode(y, state, own)

    fill = _input(t, x.shape, seed + 2)
    other_x = _with_pads(x, valid, fill if t.kind == "pack" else fill * magnitude)
    other_inputs = {n: _with_pads(v, valid, torch.randn(v.shape, generator=g) * magnitude) for n, v in inputs.items()}
    prepared, xhat = reconstruct(x, inputs)
    other_prepared, other_xhat = reconstruct(other_x, other_inputs)
    assert prepared.keys() == other_prepared.keys()
    for n in prepared:
        torch.testing.assert_close(other_prepared[n], prepared[n], rtol=0, atol=0, msg=f"prepared {n!r}")
    real = valid[:, None, :, None].expand_as(xhat)
    torch.testing.assert_close(other_xhat[real], xhat[real], rtol=0, atol=0)


@pytest.mark.parametrize("kind,name,cfg", CASES, ids=lambda v: str(v))
def test_compiled_equals_eager(kind, name, cfg):
    torch.compiler.reset()  # the same `roundtrip` code serves every case: start from a clean cache
    t = registry.transform_class(kind, name)(**cfg)
    x = _input(t, (2, 3, 64, 64), 0)
    ctx = Context(dim=64, inputs=_model_inputs(2, 64, 64))
    upstream, prepared, params = _upstream(t, 2), _prepared(t, x, ctx.inputs), _params(t, 64)

    def roundtrip(x, inputs):
        c = Context(dim=64, params=params, inputs=inputs, upstream=upstream, prepared=prepared)
        y, state = t.encode(x, c)
        return y, t.decode(y, state, c)

    eager = roundtrip(x, dict(ctx.inputs))
    compiled = torch.compile(roundtrip, fullgraph=True, options=COMPILE_OPTIONS)(x, dict(ctx.inputs))
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-5)


#: chains whose stored form decode attention reads directly (scores of keys, weighted sums of values)
READ_STORED = {
    "float16": lambda: [T.quantize("cast", dtype="float16")],
    "bfloat16-after-hadamard": lambda: [T.rotate("hadamard"), T.quantize("cast", dtype="bfloat16")],
    "uniform-token": lambda: [T.quantize(bits=4, axis="token", group=16), T.pack()],
    "uniform-channel-after-hadamard": lambda: [T.rotate("hadamard"), T.quantize(bits=2, axis="channel", group=8),
                                               T.pack()],
    "higgs-4d": lambda: [T.quantize("higgs", bits=2, dim=4), T.pack()],
    "higgs-1bit-8d-balanced": lambda: [T.project("balance"), T.quantize("higgs", bits=1, dim=8), T.pack()],
    "higgs-4bit-centred": lambda: [T.predict("center"), T.quantize("higgs", bits=4, dim=2), T.pack()],
    "higgs-3bit-words-balanced": lambda: [T.project("balance"), T.quantize("higgs", bits=3, dim=2), T.pack()],
    "higgs-token-span-centred-after-hadamard": lambda: [
        T.rotate("hadamard", block=16), T.predict("center"), T.quantize("higgs", bits=2, dim=2, span="token"), T.pack()],
    "higgs-centred-balanced": lambda: [
        T.predict("center"), T.project("balance"), T.quantize("higgs", bits=2, dim=4), T.pack()],
    "higgs-4d-unbiased": lambda: [T.quantize("higgs", bits=2, dim=4, unbiased=True), T.pack()],
    "uniform-gaussian-unbiased-after-hadamard": lambda: [
        T.rotate("hadamard"), T.quantize(bits=1, group=None, symmetric=True, step="gaussian", unbiased=True), T.pack()],
}


@pytest.mark.parametrize("chain", READ_STORED.values(), ids=READ_STORED.keys())
@given(chunks=st.integers(1, 3), seed=st.integers(0, 1000))
def test_scores_and_sums_read_from_the_stored_form_equal_the_reconstructions(chain, chunks, seed):
    chain = Chain(chain())
    assert chain.scores_stored and chain.sums_stored
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 8 * chunks, 32, generator=g) + 4 * torch.randn(32, generator=g)  # per-channel offsets
    queries = {"queries": torch.randn(2, 6, 8 * chunks, 32, generator=g) * torch.rand(32, generator=g).exp()}
    prepared = chain.prepare(x, LayerState({}, {}, queries), None) if chain.needs_prepare else {}
    own = LayerState({}, prepared, {})
    state = chain.encode(x, own, None)
    xhat = chain.decode(state, 32, own)
    by_chunk = {n: t.unflatten(2, (chunks, t.shape[2] // chunks)) for n, t in state.items()}
    q = torch.randn(2, 3, 4, 32, generator=g)
    scores = chain.scores(q, by_chunk, 32, own)
    torch.testing.assert_close(scores.flatten(-2), q @ xhat.transpose(-1, -2), rtol=1e-4, atol=1e-4)
    p = torch.softmax(scores.flatten(-2), -1)
    out = chain.weighted_sum(p.unflatten(-1, (chunks, -1)), by_chunk, 32, own)
    torch.testing.assert_close(out, p @ xhat, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("transforms,use,reason", [
    ([T.rotate("pre_rope"), T.quantize("cast")], "scores", "rotate.pre_rope.* is not an affine map"),  # RoPE
    ([T.quantize(bits=3, axis="token", group=16), T.pack()], "sums", r"pack.bits\(bits=3\) is not a planar layout"),
    ([T.quantize("higgs", bits=3, dim=2), T.pack(bits=7)], "scores", r"pack.bits\(bits=7\) is not a planar layout"),
    ([T.quantize(bits=2, axis="token", group=16)], "sums", "not packed to one of its widths"),  # unpacked codes
    ([T.quantize("schedule", bits=(4, 2), group=8), T.pack()], "scores", "is not a planar layout"),
    ([T.quantize("cast"), T.pack(bits=8)], "scores", "has no reduction over packed codes"),
])
def test_chains_that_must_rebuild_their_tokens_say_why(transforms, use, reason):
    chain = Chain(transforms)
    assert not (chain.scores_stored if use == "scores" else chain.sums_stored)
    assert re.search(reason, chain.rebuilds[use])


def test_pack_takes_width_from_quantizer():
    chain = Chain([T.quantize(bits=3, axis="token", group=32), T.pack()])
    assert chain.transforms[1].config.bits == 3
    with pytest.raises(ValueError, match="needs a quantizer before it"):
        Chain([T.pack()])


@pytest.mark.parametrize(
    "factory,kwargs,error",
    [
        (T.quantize, {"bits": 9}, "bits=9"),
        (T.quantize, {"bits": 2, "axis": "row"}, "axis='row'"),
        (T.quantize, {"bits": 2, "group": 0}, "group=0"),
        (T.quantize, {"bits": 2, "colour": 1}, "unknown option"),
        (T.pack, {"bits": 11}, "bits=11"),
        (T.rotate, {"block": 6}, "power of two"),
    ],
)
def test_bad_configuration_is_clear(factory, kwargs, error):
    with pytest.raises(ValueError, match=error):
        factory(**kwargs)


def test_token_group_must_divide_features():
    t = T.quantize(bits=2, axis="token", group=48)
    with pytest.raises(ValueError, match="group=48 must divide the feature size 64"):
        t.encode(torch.randn(1, 1, 4, 64), Context(dim=64))
