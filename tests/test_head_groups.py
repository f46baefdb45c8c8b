"""`HeadGroups`: a layer's KV heads in groups, each encoded by a chain of its own (per-KV-head widths). Compiled decode
over them on SmolLM2 equals eager in `tests/models/test_fast_decode.py` ("per-head-widths")."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchkv.fitting.tuning import candidates
from torchkv.models import parallel
from torchkv.ops import triton_decode
from torchkv.pipeline import HeadGroups, KVPipeline, codec
from torchkv.testing import tiny_model

#: chains a group may take: grid-coded keys and rotated values at two widths each, and KIVI's layout (its keys
#: grouped along tokens)
CHAINS = ("frontier-2bit", "frontier-2bit:key_bits=3:dim=2:bits=4", "kivi-4bit:group=16")
D = 64


def _sides(name: str):
    pipe = KVPipeline.from_preset(name, compile=False)
    return pipe.keys, pipe.values


def _grouped(assignment: list[int], chains: list[str], side: int) -> HeadGroups:
    """Heads grouped by their entry in `assignment`, group g encoded by chain `chains[g]`'s `side`."""
    ids = list(dict.fromkeys(assignment))  # in order of first appearance: the groups' heads are not in head order
    return HeadGroups([([h for h, a in enumerate(assignment) if a == g], _sides(chains[g])[side]) for g in ids])


def _inputs(b: int, h: int, per: int, t: int, seed: int) -> dict[str, torch.Tensor]:
    return {"queries": torch.randn(b, h * per, t, D, generator=torch.Generator().manual_seed(seed))}


@settings(max_examples=12, deadline=None)
@given(heads=st.integers(1, 4), per=st.integers(1, 3), chunks=st.integers(1, 2), data=st.data())
def test_each_group_encodes_scores_and_sums_its_heads_as_its_own_pipeline_would(heads, per, chunks, data):
    keys_of = data.draw(st.lists(st.integers(0, 2), min_size=heads, max_size=heads), label="key group of each head")
    values_of = data.draw(st.lists(st.integers(0, 2), min_size=heads, max_size=heads), label="value group")
    chains = data.draw(st.lists(st.sampled_from(CHAINS), min_size=3, max_size=3), label="chain of each group")
    pipe = KVPipeline(_grouped(keys_of, chains, 0), _grouped(values_of, chains, 1), residual=16, chunk=32,
                      compile=False)
    b, t = 2, pipe.chunk * chunks
    g = torch.Generator().manual_seed(heads * 10 + per)
    k, v = torch.randn(b, heads, t, D, generator=g), torch.randn(b, heads, t, D, generator=g)
    inputs = _inputs(b, heads, per, t, seed=1)
    prepared = pipe.prepare(k, v, inputs=inputs)
    state = pipe.encode_chunk(k, v, prepared=prepared)
    k_hat, v_hat = pipe.decode_chunk(state, head_dim=D, prepared=prepared)
    for h in range(heads):  # head h through its groups' chains alone, as a one-head pipeline
        alone = KVPipeline(_sides(chains[keys_of[h]])[0], _sides(chains[values_of[h]])[1], chunk=pipe.chunk,
                           compile=False)
        one = {"queries": inputs["queries"][:, h * per:(h + 1) * per]}
        own = alone.prepare(k[:, h:h + 1], v[:, h:h + 1], inputs=one)
        k_one, v_one = alone.decode_chunk(alone.encode_chunk(k[:, h:h + 1], v[:, h:h + 1], prepared=own), head_dim=D,
                                          prepared=own)
        assert torch.equal(k_hat[:, h:h + 1], k_one) and torch.equal(v_hat[:, h:h + 1], v_one), h
    # decode attention reads each group's stored form (scores, weighted sums) and equals attention over the rebuilt
    # tokens, with left padding masked
    assert pipe.keys.scores_stored and pipe.values.sums_stored
    q = torch.randn(b, heads * per, 1, D, generator=g)
    k_fp, v_fp = torch.randn(b, heads, 3, D, generator=g), torch.randn(b, heads, 3, D, generator=g)
    mask = torch.ones(b, 1, 1, t + 3, dtype=torch.bool)
    mask[1, ..., : data.draw(st.integers(0, t - 1), label="left padding")] = False
    encoded = {n: s.unflatten(2, (chunks, -1)) for n, s in state.items()}
    out, _, _ = pipe.attend_decode(q, encoded, k_fp, v_fp, mask, D**-0.5, prepared=prepared)
    keys, values = (torch.cat(p, 2).repeat_interleave(per, 1) for p in ((k_hat, k_fp), (v_hat, v_fp)))
    expected = torch.softmax((q @ keys.transpose(-1, -2) * D**-0.5).masked_fill(~mask, -torch.inf), -1) @ values
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    # stored bits: each head's own chain's
    bits = pipe.bits_per_value(heads, D)
    alone = [KVPipeline(*_sides(c), chunk=pipe.chunk, compile=False).bits_per_value(1, D) for c in chains]
    assert bits.keys == pytest.approx(sum(alone[a].keys for a in keys_of) / heads)
    assert bits.values == pytest.approx(sum(alone[a].values for a in values_of) / heads)


def test_head_groups_save_and_load_with_the_pipeline(tmp_path):
    grouped = HeadGroups([([0], _sides("frontier-2bit")[1]), ([1], _sides(CHAINS[1])[1])])
    pipe = KVPipeline(*_sides("frontier-2bit"), residual=16, layers={1: (_sides("frontier-2bit")[0], grouped)},
                      compile=False)
    pipe.save_pretrained(tmp_path)
    loaded = KVPipeline.from_pretrained(tmp_path)
    loaded.compile = False
    assert loaded.config() == pipe.config()
    assert isinstance(loaded.for_layer(1).values, HeadGroups) and loaded.for_layer(0).values is loaded.values
    assert "heads [1]" in repr(loaded)
    k, v = torch.randn(2, 1, 2, 32, D).unbind(0)
    decoded = []
    for p in (pipe.for_layer(1), loaded.for_layer(1)):
        prepared = p.prepare(k, v, inputs=_inputs(1, 2, 1, 32, seed=0))
        decoded.append(p.decode_chunk(p.encode_chunk(k, v, prepared=prepared), head_dim=D, prepared=prepared))
    assert all(torch.equal(a, b) for a, b in zip(*decoded))


def test_bad_head_groups_are_refused_with_what_to_do():
    keys, _ = _sides("frontier-2bit")
    for groups in ([([0, 2], keys)], [([0], keys), ([0, 1], keys)], [([], keys), ([0], keys)]):
        with pytest.raises(ValueError, match=r"must be non-empty and hold the KV heads 0..H-1 once each"):
            HeadGroups(groups)
    with pytest.raises(TypeError, match=r"a chain takes Transform objects, got str"):
        KVPipeline("balance", [])
    with pytest.raises(ValueError, match=r"cannot hold \[predict.linear.*group chains fitted per sequence only"):
        HeadGroups([([0], KVPipeline.from_preset("aquakv-2bit").keys)])
    pipe = KVPipeline(HeadGroups([([0], keys), ([1], _sides(CHAINS[1])[0])]), _sides("frontier-2bit")[1],
                      compile=False)
    k = torch.randn(1, 3, 32, D)
    with pytest.raises(ValueError, match=r"cover 2 KV heads, and the layer has 3: tune or build per-head widths"):
        pipe.prepare(k, k, inputs=_inputs(1, 3, 1, 32, seed=0))
    with pytest.raises(ValueError, match=r"cannot carry its reconstruction to the next layer"):
        pipe.carries = True
    with pytest.raises(ValueError, match=r"has per-KV-head widths; tune the pipeline it was tuned from"):
        candidates(pipe, 2, D)


@pytest.mark.skipif(triton_decode.triton is None, reason="needs triton")
def test_each_pair_of_chains_attends_its_heads_with_its_gpu_kernel(monkeypatch):
    """A layer's heads are grouped by (key chain, value chain) pair, and each group is attended by its pair's `Codec`,
    whose Triton kernel (under the interpreter here, eagerly) gives what the reductions over the stored form give."""
    monkeypatch.setattr(codec, "EAGER_CALLS_BEFORE_COMPILE", 10)  # eager: the kernels under torch.compile are
    # tested in tests/ops/test_triton_decode.py
    frontier, kivi, wide = (_sides(c) for c in ("frontier-2bit", CHAINS[2], CHAINS[1]))
    pipe = KVPipeline(*frontier, residual=16, chunk=16, layers={
        1: (HeadGroups([([0, 2], frontier[0]), ([1], kivi[0])]), HeadGroups([([0, 2], frontier[1]), ([1], kivi[1])])),
        2: (HeadGroups([([0], kivi[0]), ([1, 2], frontier[0])]), HeadGroups([([0], kivi[1]), ([1], frontier[1]),
                                                                              ([2], wide[1])])),
    })
    one, two = pipe.for_layer(1), pipe.for_layer(2)
    assert one.keys.heads == [(0, 2), (1,)] and two.keys.heads == two.values.heads == [(0,), (1,), (2,)]
    assert [(c.keys.spec(), c.values.spec()) for c in two.codec.groups] == [
        (kivi[0].spec(), kivi[1].spec()), (frontier[0].spec(), frontier[1].spec()),
        (frontier[0].spec(), wide[1].spec())]
    assert one.codec.kernel(D) == ("grid+kivi", None)
    assert "layer 1: keys scored from the stored form; values summed from the stored form; on CUDA the Triton kernel " \
           "over grid-coded keys and the Triton kernel over KIVI's layout; KV heads in 2 groups" in pipe.explain(3)
    b, h, per, t = 2, 3, 2, 2 * one.chunk  # two chunks of 16 tokens
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(b, h, t, D, generator=g), torch.randn(b, h, t, D, generator=g)
    prepared = one.prepare(k, v, inputs=_inputs(b, h, per, t, seed=1))
    encoded = {n: s.unflatten(2, (2, -1)) for n, s in one.encode_chunk(k, v, prepared=prepared).items()}
    q, k_fp, v_fp = torch.randn(b, h * per, 1, D, generator=g), *torch.randn(2, b, h, 5, D, generator=g)
    mask = torch.ones(b, 1, 1, t + 5, dtype=torch.bool)
    mask[1, ..., :7] = False
    outs = []
    for on_gpu in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(triton_decode, "runs_on", lambda device: on_gpu)
            outs.append(one.attend_decode(q, encoded, k_fp, v_fp, mask, D**-0.5, layer=1, prepared=prepared))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-5, rtol=1e-4)


def test_tensor_parallelism_refuses_per_head_widths(monkeypatch):
    monkeypatch.setattr(parallel, "tp_size", lambda model: 2)  # the model's 2 KV heads on 2 ranks
    keys, values = _sides("frontier-2bit")
    pipe = KVPipeline(HeadGroups([([0], keys), ([1], _sides(CHAINS[1])[0])]), values)
    with pytest.raises(NotImplementedError, match="per-KV-head widths name the model's KV heads, and a rank holds"):
        parallel.check_tensor_parallel(tiny_model("llama", kv_heads=2), pipe)
