"""Per-layer chains in a pipeline, the tuner's candidates and sensitivities, and `tune` end to end."""

import dataclasses
import json
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import torchkv
import torchkv.transforms as T
from torchkv.models import cache_argument
from torchkv.models.arch import full_layers
from torchkv.pipeline import HeadGroups, KVPipeline
from torchkv.pipeline.chain import chain_spec
from torchkv.testing import tiny_model
from torchkv.fitting.tuning import (CANDIDATE_BITS, candidates, measure, sensitivity, stored_bits, tune,
                                    tuned_for_model, tuned_pipeline)
from torchkv.fitting.tuning.candidates import layer_candidates, rewidth
from torchkv.fitting.tuning.sensitivity import (Probe, _exposed_gradients, _probed, _sampled_gradients, exposed_pairs,
                                                read_weights)
from torchkv.store import flushed

IDS = torch.randint(3, 128, (3, 256), generator=torch.Generator().manual_seed(0))


def _kivi(bits: int) -> tuple[list, list]:
    return ([T.quantize(bits=bits, axis="channel", group=16), T.pack()],
            [T.quantize(bits=bits, axis="token", group=16), T.pack()])


def test_layers_with_equal_chains_share_them_and_round_trip(tmp_path):
    pipe = KVPipeline(*_kivi(4), layers={0: _kivi(2), 2: _kivi(2), 3: _kivi(4)}, residual=16)
    assert set(pipe.layer_chains) == {0, 2}  # layer 3's chains are the main ones
    assert pipe.layer_chains[0][0] is pipe.layer_chains[2][0]
    assert pipe.for_layer(0) is pipe.for_layer(2) and pipe.for_layer(1) is pipe.for_layer(3) is pipe
    groups: dict[int, list[int]] = {}  # layers by the chains that encode them
    for layer in range(4):
        groups.setdefault(id(pipe.for_layer(layer).keys), []).append(layer)
    assert list(groups.values()) == [[0, 2], [1, 3]]
    assert "layers 0,2: keys=[quantize.uniform(bits=2" in repr(pipe)
    assert "every layer: keys scored from the stored form" in pipe.explain(4)
    pipe.save_pretrained(tmp_path)
    loaded = KVPipeline.from_pretrained(tmp_path)
    assert loaded.config() == pipe.config()
    bits = loaded.bits_per_value(2, 32, layers=4)
    assert bits.keys == pytest.approx((KVPipeline(*_kivi(2)).bits_per_value(2, 32).keys + 4 + 2) / 2)


def test_fitted_tensors_shared_by_tuned_layers_are_saved_once_and_load_shared(tmp_path):
    """Tuned layers keep the preset's fitted transforms (AQUA-KV's predictors), so several chains hold one tensor."""
    from safetensors.torch import load_file

    pipe = KVPipeline.from_preset("aquakv-2bit")
    gen = torch.Generator().manual_seed(0)
    for t in (*pipe.keys.transforms, *pipe.values.transforms):
        if t.name == "linear":
            t.params = {f"{layer}.{name}": torch.randn(*shape, generator=gen)
                        for layer in (1, 2) for name, shape in (("weight", (8, 8)), ("bias", (8,)))}
    tuned = KVPipeline(list(pipe.keys.transforms), list(pipe.values.transforms),
                       layers={2: (rewidth(pipe.keys, 4), rewidth(pipe.values, 4))})
    params = tuned.params()
    distinct = len({id(v) for v in params.values()})
    assert distinct < len(params)
    tuned.save_pretrained(tmp_path)
    assert len(load_file(tmp_path / torchkv.pipeline.PARAMS_FILE)) == distinct
    loaded = KVPipeline.from_pretrained(tmp_path).params()
    assert loaded.keys() == params.keys() and all(torch.equal(loaded[k], v) for k, v in params.items())
    assert len({id(v) for v in loaded.values()}) == distinct


def test_candidates_are_measured_once_per_distinct_layer_pipeline(monkeypatch):
    pipe = KVPipeline(*_kivi(4), layers={0: _kivi(2), 2: _kivi(2), 3: _kivi(4)}, residual=16)
    measured = []
    real = candidates  # the package's name `candidates` is the function, which hides its module of that name
    monkeypatch.setattr(sys.modules[layer_candidates.__module__], "candidates",
                        lambda p, *args: measured.append(p) or real(p, *args))
    options = layer_candidates(pipe, 4, 2, 32)
    assert measured == [pipe.for_layer(0), pipe]  # layers 0 and 2 share one pipeline, 1 and 3 the main one
    assert options[0] is options[2] and options[1] is options[3] and options[0] is not options[1]
    for layer, layer_pipe in ((0, pipe.for_layer(0)), (1, pipe)):  # the same settings as measured alone
        alone = real(layer_pipe, 2, 32)
        assert {side: [(c.label, c.bits) for c in cs] for side, cs in options[layer].items()} == {
            side: [(c.label, c.bits) for c in cs] for side, cs in alone.items()}


def test_a_config_saved_with_first_layers_loads_them_as_per_layer_chains():
    config = KVPipeline(*_kivi(2), residual=16).config()
    del config["layers"]
    config["first_layers"] = [{"keys": [t.spec() for t in KVPipeline(*_kivi(4)).keys.transforms],
                               "values": [t.spec() for t in KVPipeline(*_kivi(4)).values.transforms]}]
    pipe = KVPipeline.from_config(config)
    assert list(pipe.layer_chains) == [0] and pipe.for_layer(0).keys.transforms[0].config.bits == 4


def _graphs_for(layer_chains: list, steps: int = 300) -> tuple[int, int]:
    """Compiled graphs added by a prompt and `steps` greedy decode steps, and those added after step 100."""
    model = tiny_model("llama", layers=len(layer_chains))
    pipe = KVPipeline(*layer_chains[-1], layers=dict(enumerate(layer_chains)), residual=16)
    start = counters["stats"]["unique_graphs"]
    with torchkv.patched(model, pipe), torch.no_grad():
        cache = torchkv.new_cache(model)
        logits = model(IDS[:1, :50], **cache_argument(model, cache)).logits
        for step in range(steps):
            logits = model(logits[:, -1:].argmax(-1), **cache_argument(model, cache)).logits
            if step == 100:
                middle = counters["stats"]["unique_graphs"]
    return counters["stats"]["unique_graphs"] - start, counters["stats"]["unique_graphs"] - middle


def test_mixed_layers_compile_one_set_of_graphs_per_distinct_setting_and_none_as_length_grows():
    uniform, _ = _graphs_for([_kivi(2), _kivi(2)])
    mixed, late = _graphs_for([_kivi(2), _kivi(4), _kivi(2), _kivi(4), _kivi(2), _kivi(4)])
    assert late == 0, f"{late} graphs compiled after decode step 100"
    assert mixed <= 2 * uniform, f"{mixed} graphs for 2 settings over 6 layers, {uniform} for one setting"


def test_candidates_keep_decode_reading_and_their_bits_are_the_closed_form():
    pipe = KVPipeline.from_preset("kivi-2bit")
    options = candidates(pipe, kv_heads=3, head_dim=64)
    for side, cands in options.items():
        assert [c.bits for c in cands] == sorted(c.bits for c in cands)
        for c in cands:
            chain = torchkv.pipeline.Chain(list(c.transforms))
            assert chain.scores_stored and chain.sums_stored
            group = c.transforms[0].config.group
            assert c.bits == pytest.approx(c.width + 2 * 16 / group)  # fp16 scale and zero per group
    frontier = KVPipeline.from_preset("frontier-2bit")
    k = rewidth(frontier.keys, 4)
    assert k[0] is frontier.keys.transforms[0] and (k[1].config.bits, k[1].config.dim) == (4, 2)  # no 4-D 4-bit grid
    assert (rewidth(frontier.keys, 1)[1].config.dim) == 8  # the 1-bit grid is 8-D
    options = candidates(frontier, kv_heads=3, head_dim=64)
    keys, values = options["k"], options["v"]
    # codes and one float8 norm per 64; the 2.5-, 3- and 3.5-bit grids' 5-, 6- and 7-bit codes are read from their words
    assert [(c.width, c.bits) for c in keys] == [(w, w + 8 / 64) for w in (2, 2.5, 3, 3.5, 4)]
    assert [(t.config.bits, t.config.dim) for c in keys for t in c.transforms if t.name == "higgs"] == [
        (2, 4), (2.5, 2), (3, 2), (3.5, 2), (4, 2)]
    assert [c.width for c in values][0] == 1  # 1-bit values are candidates; 1-bit keys are not (CANDIDATE_BITS)
    assert all(torchkv.pipeline.Chain(list(c.transforms)).scores_stored for c in keys)
    assert rewidth(KVPipeline.from_preset("fp16").keys, 2) is None  # nothing to rewiden


def test_sensitivities_fall_with_width_and_tune_meets_the_budget(tmp_path):
    model = tiny_model("llama", layers=3)
    pipe = KVPipeline.from_preset("kivi-2bit", group=16, residual=16)
    sensitivity = measure(pipe, model, IDS, progress=False)
    for layer in range(3):
        for side, cands in sensitivity.candidates[layer].items():
            at_g16 = {c.width: cost for c, cost in zip(cands, sensitivity.costs[layer][side]) if c.group_scale == 1}
            widths = sorted(at_g16)
            assert (widths[0], widths[-1]) == (CANDIDATE_BITS[side][0], 8), (layer, side, widths)
            costs = [at_g16[w] for w in widths]
            assert all(a > b for a, b in zip(costs, costs[1:])) and costs[-1] > 0, (layer, side, at_g16)
    tuned, report = tune(pipe, model, IDS, budget=2.6, progress=False)
    bits = tuned.bits_per_value(2, 32, layers=3)
    assert bits.mean <= 2.6 + 1e-9 and bits.mean == pytest.approx(report["bits_per_value"])
    assert report["tokens"] == IDS.numel() and report["seconds"] > 0 and report["peak_rss_mib"] > 0
    tuned.save_pretrained(tmp_path)
    (tmp_path / "tune.json").write_text(json.dumps(report))
    with torchkv.patched(model, str(tmp_path)), torch.no_grad():
        out = model.generate(IDS[:1, :40], max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 45)
    other = tiny_model("llama", layers=3, kv_heads=4)
    with pytest.raises(ValueError, match=r"tuned for another model \(differs in \['config_sha1', 'kv_heads'\]"):
        torchkv.patch(other, str(tmp_path))


def test_per_head_costs_split_the_layer_cost_and_per_head_tuning_meets_the_budget_below_its_cost():
    pipe = KVPipeline.from_preset("frontier-2bit", residual=16)
    one = tiny_model("llama", layers=2, kv_heads=1)
    measured = measure(pipe.for_model(one), one, IDS, progress=False)
    for layer, heads in zip(measured.costs, measured.head_costs):  # one KV head: its cost is the layer's
        for side in ("k", "v"):
            torch.testing.assert_close(torch.stack(heads[side])[:, 0].double(), torch.tensor(layer[side], dtype=torch.float64), rtol=1e-4,
                                       atol=0)
    model = tiny_model("llama", layers=3, kv_heads=2)
    measured = measure(pipe.for_model(model), model, IDS, progress=False)
    by_layer = tuned_pipeline(measured, 2.5)[1]
    tuned, report = tuned_for_model(measured, model, 2.5, per_head=True)
    assert report["per_head"] and len(report["head_sensitivity"]) == 3
    assert any(isinstance(chain, HeadGroups) for pair in tuned.layer_chains.values() for chain in pair)
    bits = tuned.bits_per_value(2, 32, layers=3)
    assert bits.mean <= 2.5 + 1e-9 and bits.mean == pytest.approx(report["bits_per_value"])

    def head_sums(row: dict, side: str, key: str) -> float:  # the per-layer choice priced by its heads' costs
        labels = [c.label for c in measured.candidates[row["layer"]][side]]
        return float(measured.head_costs[row["layer"]][side][labels.index(row[key])].sum())

    layer_choice = sum(head_sums(row, s, key) for row in by_layer["layers"] for s, key in (("k", "keys"), ("v", "values")))
    assert report["predicted_kl"] <= layer_choice + 1e-12  # the per-head choices include the per-layer ones
    tuned.compile = False  # each distinct grouping of a layer's heads compiles graphs of its own
    with torchkv.patched(model, tuned), torch.no_grad():
        out = model.generate(IDS[:1, :60], max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 65)
    with pytest.raises(ValueError, match="per-head widths need the sensitivity split by KV head"):
        tuned_pipeline(dataclasses.replace(measured, head_costs=[]), 2.5, per_head=True)


JOINT_PARTNERS = [{"rotary_center": True}, {"values": "higgs"}, {"span": "token"}, {"unbiased_values": True}]


@settings(max_examples=4, deadline=None)
@given(partner=st.sampled_from(JOINT_PARTNERS), kv_heads=st.sampled_from([1, 2]))
def test_presets_measured_together_cost_what_each_costs_alone_and_tune_over_the_union(partner, kv_heads):
    """`measure(pipe, ..., also=[other])`: every candidate of either preset costs what measuring its preset alone on
    the same windows gives (one forward and backward pass serve both); a chain both offer is measured once, under the
    first's label; the other's labels carry its spelling; each side stays cheapest first; the choice over the union
    predicts no more KL than either preset's alone, and the report names the other preset."""
    from torchkv.pipeline.presets import spelling

    model = tiny_model("llama", layers=2, kv_heads=kv_heads)
    pipe = KVPipeline.from_preset("frontier-2bit", residual=16).for_model(model)
    other = KVPipeline.from_preset("frontier-2bit", residual=16, **partner).for_model(model)
    alone = [measure(p, model, IDS[:2], progress=False) for p in (pipe, other)]
    joint = measure(pipe, model, IDS[:2], progress=False, also=[other])
    prefix = spelling(other) + "/"
    for layer in range(2):
        for side in ("k", "v"):
            ours = dict(zip((c.label for c in joint.candidates[layer][side]), joint.costs[layer][side]))
            first = dict(zip((c.label for c in alone[0].candidates[layer][side]), alone[0].costs[layer][side]))
            second = {prefix + c.label: cost for c, cost in zip(alone[1].candidates[layer][side],
                                                                 alone[1].costs[layer][side])}
            assert first.items() <= ours.items() and set(ours) <= set(first) | set(second)
            for label, cost in ours.items():
                assert cost == pytest.approx(first.get(label, second.get(label)), rel=1e-5, abs=1e-12)
            specs = [chain_spec(torchkv.pipeline.Chain(list(c.transforms))) for c in joint.candidates[layer][side]]
            assert len(set(specs)) == len(specs)  # each chain once
            bits = [c.bits for c in joint.candidates[layer][side]]
            assert bits == sorted(bits)
            heads = dict(zip(ours, joint.head_costs[layer][side]))
            for label, per_head in zip(first, alone[0].head_costs[layer][side]):
                torch.testing.assert_close(heads[label], per_head, rtol=1e-5, atol=1e-12)
    tuned, report = tuned_for_model(joint, model, 2.5)
    assert report["also_presets"] == [spelling(other)] and report["preset"] == spelling(pipe)
    assert report["predicted_kl"] <= min(tuned_for_model(m, model, 2.5)[1]["predicted_kl"] for m in alone) * (1 + 1e-9)
    assert tuned.bits_per_value(kv_heads, 32, layers=2).mean <= 2.5 + 1e-9


def test_presets_tuned_together_must_keep_the_same_exact_tokens_and_not_predict_across_layers():
    model = tiny_model("llama", layers=2)
    pipe = KVPipeline.from_preset("frontier-2bit", residual=16)
    with pytest.raises(ValueError, match=r"'frontier-2bit:residual=32' keeps other exact tokens than "
                                         r"'frontier-2bit:residual=16' \(residual, sinks, chunk and window"):
        tune(pipe, model, IDS, budget=2.5, progress=False, also=[KVPipeline.from_preset("frontier-2bit", residual=32)])
    carrying = KVPipeline.from_preset("frontier-2bit", residual=16, rotary_center=True)
    carrying.carries = True
    with pytest.raises(ValueError, match="predicts across layers, so its costs depend on its own chains: tune it "
                                         "alone"):
        measure(pipe, model, IDS, progress=False, also=[carrying])


def test_bad_budgets_and_uncalibrated_methods_are_refused_with_what_to_do():
    model = tiny_model("llama", layers=2)
    pipe = KVPipeline.from_preset("kivi-2bit", group=16, residual=16)
    for budget in (0.5, 17.0):
        # least: 2-bit keys in groups of 64 tokens (2.5 bits) and 1-bit values in groups of 32 channels (2 bits)
        with pytest.raises(ValueError, match=r"outside what tuning can meet: the candidate settings reach 2\.25 to 10 "):
            tune(pipe, model, IDS, budget=budget, progress=False)
    with pytest.raises(ValueError, match="uncalibrated transforms .*`torchkv calibrate --preset aquakv-2bit"):
        tune(KVPipeline.from_preset("aquakv-2bit"), model, IDS, budget=2.5, progress=False)
    with pytest.raises(ValueError, match=r"windows of 24 tokens store no token encoded .* at least 32 tokens"):
        tune(pipe, model, IDS[:, :24], budget=2.6, progress=False)  # 16 exact + a 16-token chunk


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 300), sinks=st.integers(0, 6), residual=st.integers(0, 64),
       chunk=st.sampled_from([16, 32]))
def test_exposed_pairs_are_the_keys_each_decode_step_reads_encoded(tokens, sinks, residual, chunk):
    pipe = KVPipeline(*_kivi(2), residual=residual, sinks=sinks, chunk=chunk)
    exposed = exposed_pairs(pipe, tokens)
    for query in range(tokens):  # the store after appending tokens 0..query one at a time
        held = max(query + 1 - sinks, 0)
        encoded = flushed(held, residual + chunk, chunk)
        assert exposed[query].tolist() == [sinks <= key < sinks + encoded for key in range(tokens)]


def _softcapped_attention(q, k, v, scale: float, softcap: float) -> torch.Tensor:
    """Causal attention with logits `softcap·tanh(s/softcap)`, as Gemma 2's eager attention, `[B, Hq, T, D]`."""
    scores = softcap * torch.tanh(scale * q @ k.transpose(-1, -2) / softcap)
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v


@pytest.mark.parametrize("kv_heads,softcap", [(1, None), (2, None), (2, 1.5)])
def test_exposed_gradients_of_every_pair_are_the_attention_gradients(kv_heads, softcap):
    """With every causal pair exposed, the gradients equal autograd's through SDPA (soft-capped attention where the
    model soft-caps its logits) over perturbed keys and values; with none exposed, they are zero; a pair's exposure
    moves only its own key's gradient."""
    g = torch.Generator().manual_seed(0)
    b, hq, t, d = 2, 4, 300, 16
    q, k, v = torch.randn(b, hq, t, d, generator=g), torch.randn(b, kv_heads, t, d, generator=g), \
        torch.randn(b, kv_heads, t, d, generator=g)
    out_grad = torch.randn(b, t, hq, d, generator=g)
    dk, dv = (torch.zeros_like(x, requires_grad=True) for x in (k, v))
    groups = hq // kv_heads
    keys, values = (k + dk).repeat_interleave(groups, 1), (v + dv).repeat_interleave(groups, 1)
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, is_causal=True)
    else:
        out = _softcapped_attention(q, keys, values, d**-0.5, softcap)
    (out.transpose(1, 2) * out_grad).sum().backward()
    probe = Probe(q, k, v, None, d**-0.5, torch.zeros(b, t, hq, d), softcap=softcap)
    if softcap is not None:  # the capping changes the gradients: without it they differ
        uncapped = _exposed_gradients(dataclasses.replace(probe, softcap=None), out_grad,
                                      torch.ones(t, t, dtype=torch.bool).tril())[0]
        assert not torch.allclose(uncapped, dk.grad, atol=1e-2, rtol=1e-2)
    every = torch.ones(t, t, dtype=torch.bool).tril()
    g_k, g_v = _exposed_gradients(probe, out_grad, every)
    torch.testing.assert_close(g_k, dk.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g_v, dv.grad, atol=1e-4, rtol=1e-4)
    assert all(x.abs().max() == 0 for x in _exposed_gradients(probe, out_grad, torch.zeros(t, t, dtype=torch.bool)))
    far = every.clone()
    far[:, 100:] = False  # keys from 100 on exposed to no query
    g_k, g_v = _exposed_gradients(probe, out_grad, far)
    assert g_k[:, :, 100:].abs().max() == 0 and g_v[:, :, 100:].abs().max() == 0
    torch.testing.assert_close(g_k[:, :, :100], dk.grad[:, :, :100], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g_v[:, :, :100], dv.grad[:, :, :100], atol=1e-4, rtol=1e-4)


def test_sampled_gradients_are_those_of_the_loss_weighted_by_encoded_reads():
    """Each position's cross-entropy weighs the encoded keys it reads over their mean (`read_weights`): the
    gradients equal autograd's of `Σ_i w_i CE_i` with the same sampled labels, for every row of a batch."""
    model = tiny_model("llama", layers=2)
    pipe = KVPipeline.from_preset("frontier-2bit", residual=16).for_model(model)
    ids = IDS[:2, :96]
    exposed = exposed_pairs(pipe, ids.shape[1])
    weights, reads = read_weights(exposed), exposed.sum(1).float()
    torch.testing.assert_close(weights, reads / reads.mean())
    assert weights[0] == 0 and weights[-1] > 1
    probes: dict = {}
    with _probed(model, probes), torch.enable_grad():
        got = _sampled_gradients(model, ids, probes, torch.Generator().manual_seed(0), 1, exposed)
    reference: dict = {}
    with _probed(model, reference), torch.enable_grad():
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        logits = model.get_output_embeddings()(hidden.flatten(0, 1)).float()  # [B·T, V]: one `LOGIT_CHUNK`
        labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=torch.Generator().manual_seed(0))
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 0], reduction="none")
        (loss * weights.repeat(ids.shape[0])).sum().backward()
    for layer, probe in reference.items():
        (g_k, g_v), = got[layer]
        want_k, want_v = _exposed_gradients(probe, probe.out.grad, exposed)
        torch.testing.assert_close(g_k, want_k)
        torch.testing.assert_close(g_v, want_v)
        assert g_v.abs().max() > 0


@pytest.mark.model
def test_reallocating_a_tuned_folder_reproduces_it_and_meets_a_lower_budget():
    """`benchmarks/reallocate.py` on the committed recommended folder: at its own budget it chooses its widths again
    (the allocation is exact and deterministic); at 2.1 bits it meets the budget; 1-bit values left out, none remain;
    weighted keys cost no less."""
    from pathlib import Path

    from torchkv.testing import load_script

    root = Path(__file__).resolve().parents[2]
    module = load_script(root / "benchmarks/reallocate.py")
    src = root / "benchmarks/results/domains/tuned/frontier-2bit@2.5_mixed_no_1bit_keys"
    saved = json.loads((src / "tune.json").read_text())
    again = module.reallocate(src, saved["budget"], {"k": 1, "v": 1})[1]
    widths = [(layer["keys"], layer["values"]) for layer in saved["layers"]]
    assert [(layer["keys"], layer["values"]) for layer in again["layers"]] == widths
    assert again["predicted_kl"] == pytest.approx(saved["predicted_kl"])
    lower, report = module.reallocate(src, 2.1, {"k": 1, "v": 1})
    assert report["bits_per_value"] <= 2.1 and report["predicted_kl"] > saved["predicted_kl"]
    assert lower.tuned_on == "mixed" and report["reallocated_from"] == str(src)
    no_1bit_values = module.reallocate(src, 2.5, {"k": 1, "v": 2})[1]
    assert min(layer["value_bits"] for layer in no_1bit_values["layers"]) >= 2
    keys_first = module.reallocate(src, 2.5, {"k": 1, "v": 1}, key_weight=4.0)[1]  # priced by the measured costs
    assert keys_first["predicted_kl"] == pytest.approx(sum(x["key_kl"] + x["value_kl"] for x in keys_first["layers"]))
    assert keys_first["predicted_kl"] >= again["predicted_kl"] * (1 - 1e-9)  # the unweighted choice is the optimum
    measured = [cost for layer in saved["sensitivity"] for side in ("k", "v") for cost in layer[side].values()]
    reported = [cost for layer in keys_first["sensitivity"] for side in ("k", "v") for cost in layer[side].values()]
    assert reported == pytest.approx(measured, rel=1e-12)  # the report keeps the measured costs
    with pytest.raises(ValueError, match="outside what tuning can meet"):
        module.reallocate(src, 1.5, {"k": 1, "v": 1})
    with pytest.raises(ValueError, match="positive factor"):
        module.reallocate(src, 2.5, {"k": 1, "v": 1}, key_weight=0.0)


@pytest.mark.model
def test_reallocating_with_whole_widths_leaves_out_the_half_bit_keys():
    """`benchmarks/reallocate.py --whole-widths` on a committed per-head folder tuned with half-bit key widths: none
    of them is chosen again, the budget holds, the predicted KL is no lower (fewer candidates), and the choice is the
    committed whole-width folder's; without it, the folder's own choice comes back."""
    from pathlib import Path

    from torchkv.testing import load_script

    root = Path(__file__).resolve().parents[2]
    module = load_script(root / "benchmarks/reallocate.py")
    tuned = root / "benchmarks/results/domains/ablations/tuned"
    src = tuned / "frontier-2bit@2.5_generated_per_head_far"
    one = {"k": 1, "v": 1}
    both = module.reallocate(src, 2.5, one)[1]
    whole = module.reallocate(src, 2.5, one, whole_widths=True)[1]

    def key_labels(report):
        return {label for layer in report["layers"]
                for label in (layer["keys"] if isinstance(layer["keys"], dict) else [layer["keys"]])}

    assert both["layers"] == json.loads((src / "tune.json").read_text())["layers"]
    assert {"higgs2.5x2", "higgs3.5x2"} & key_labels(both)
    assert not {"higgs2.5x2", "higgs3.5x2"} & key_labels(whole)
    assert whole["bits_per_value"] <= 2.5 and whole["whole_widths"]
    assert whole["predicted_kl"] >= both["predicted_kl"] * (1 - 1e-9)
    committed = json.loads((tuned / "frontier-2bit@2.5_generated_per_head_far_whole_widths/tune.json").read_text())
    assert whole["layers"] == committed["layers"]


@pytest.mark.model
def test_reallocating_over_two_presets_measured_on_the_same_windows_takes_the_better_of_each(tmp_path):
    """`benchmarks/reallocate.py --also`: the committed per-head folders tuned with and without `rotary_center` on
    the same windows, merged, predict no more KL at the same budget than either alone (a superset of candidates),
    and centre the keys of some heads only; a folder merged with itself is itself; costs that disagree, or a folder
    tuned on other windows, are refused; a folder saved before "per_head" was recorded counts as per layer; a
    folder's own widths (`--widths-of`) give its own choice back."""
    import shutil
    from pathlib import Path

    from torchkv.testing import load_script

    root = Path(__file__).resolve().parents[2]
    module = load_script(root / "benchmarks/reallocate.py")
    tuned = root / "benchmarks/results/domains/ablations/tuned"
    plain = tuned / "frontier-2bit@2.5_mixed_per_head_far"
    centred = tuned / "frontier-2bit@2.5_mixed_per_head_rotary_center"
    one = {"k": 1, "v": 1}
    alone = [module.reallocate(src, 2.5, one)[1] for src in (plain, centred)]
    pipe, merged = module.reallocate(plain, 2.5, one, also=(centred,))
    assert merged["bits_per_value"] <= 2.5 and merged["also"] == [str(centred)]
    assert merged["predicted_kl"] <= min(report["predicted_kl"] for report in alone) * (1 + 1e-9)
    labels = [label for layer in merged["layers"] for label in
              (layer["keys"] if isinstance(layer["keys"], dict) else {layer["keys"]: None})]
    ours = [label.startswith("frontier-2bit:rotary_center=True/") for label in labels]
    assert any(ours) and not all(ours)
    assert any("rotary_center" in t.name for chains in pipe.layer_chains.values() for t in chains[0].transforms)
    assert module.reallocate(plain, 2.5, one, also=(plain,))[1]["layers"] == alone[0]["layers"]
    bent = tmp_path / "bent"
    shutil.copytree(plain, bent)
    report = json.loads((bent / "tune.json").read_text())
    report["sensitivity"][3]["v"]["uniform2"] *= 1.2
    (bent / "tune.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match="layer 3's uniform2 costs .* measured on other windows"):
        module.reallocate(plain, 2.5, one, also=(bent,))
    with pytest.raises(ValueError, match="other calibration windows"):
        module.reallocate(plain, 2.5, one, also=(tuned / "frontier-2bit@2.5_wiki_per_head_far",))
    older = root / "benchmarks/results/domains/tuned/frontier-2bit@2.5_mixed_no_1bit_keys"  # no "per_head" saved
    today = tmp_path / "today"
    shutil.copytree(older, today)
    report = json.loads((today / "tune.json").read_text())
    assert "per_head" not in report
    (today / "tune.json").write_text(json.dumps({**report, "per_head": False}))  # what a per-layer tuning writes now
    merged = module.reallocate(older, 2.5, one, also=(today,))[1]
    assert merged["layers"] == module.reallocate(older, 2.5, one)[1]["layers"]
    # --widths-of: a folder's own widths give its own choice back; per-head folders and unknown labels are refused
    kept = module.reallocate(older, 2.5, one, also=(today,), widths_of=older)[1]
    assert kept["layers"] == merged["layers"] and kept["widths_of"] == str(older)
    with pytest.raises(ValueError, match="tuned per KV head"):
        module.reallocate(plain, 2.5, one, widths_of=plain)
    report["layers"][2]["values"] = "nonesuch"
    (today / "tune.json").write_text(json.dumps({**report, "per_head": False}))
    with pytest.raises(ValueError, match="layer 2's values 'nonesuch' is none of the candidates"):
        module.reallocate(older, 2.5, one, widths_of=today)


def test_probed_attention_is_the_models_own_with_its_logit_soft_capping():
    """The sensitivity probes run Gemma 2's attention with its logit soft-capping, which SDPA has not: the probed
    model's logits are its own (eager attention), and a probe records the cap."""
    model = tiny_model("gemma2", layers=2, attn_logit_softcapping=0.5)  # a cap that the tiny model's logits reach
    ids = IDS[:2, :96]
    with torch.no_grad():
        want = model(ids).logits
    probes: dict = {}
    with _probed(model, probes), torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [p.softcap for p in probes.values()] == [0.5, 0.5]
    uncapped = tiny_model("gemma2", layers=2, attn_logit_softcapping=None)  # the same weights
    with _probed(uncapped, {}), torch.no_grad():
        assert not torch.allclose(uncapped(ids).logits, want, atol=1e-3)  # the cap matters here


def test_soft_capped_probes_hold_no_attention_probabilities_for_the_backward_pass(monkeypatch):
    """The dense soft-capped attention of the probes is recomputed in the backward pass: no float `[.., T, T]`
    tensor is saved for it, where without recomputation the probabilities are, and the probes' gradients are the
    same either way."""
    model = tiny_model("gemma2", layers=2, attn_logit_softcapping=0.5)
    ids, t = IDS[:1, :200], 200

    def leaf_gradients() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        probes, saved = {}, []

        def pack(x: torch.Tensor) -> torch.Tensor:
            if x.is_floating_point() and tuple(x.shape[-2:]) == (t, t):
                saved.append(x)
            return x

        with _probed(model, probes), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            model(ids).logits.square().sum().backward()
        return [probes[i].out.grad for i in sorted(probes)], saved

    recomputed, saved = leaf_gradients()
    assert not saved
    monkeypatch.setattr(sensitivity, "checkpoint", lambda fn, *args, use_reentrant, **kwargs: fn(*args, **kwargs))
    held, saved = leaf_gradients()
    assert saved  # the probabilities, held for every layer
    for a, b in zip(recomputed, held, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma2"])
def test_a_model_with_sliding_layers_is_tuned_within_the_budget_at_every_context(model_type):
    """Gemma 3's (and Gemma 2's) sliding-window layers hold at most their window and its other layers every token,
    so its cache's bits per value move from the mean over layers (short contexts) to the mean over the full layers
    (long ones): tuning holds both within the budget. Measured on the cache after a prompt four windows long.
    Gemma 2 soft-caps its attention logits, and its sensitivities are measured so."""
    kinds = ["sliding_attention", "full_attention"] * 2
    model = tiny_model(model_type, layers=4, sliding_window=64, layer_types=kinds)
    full = [1, 3]
    assert full_layers(model) == full and 0 < len(full) < 4 and full_layers(tiny_model("llama", layers=4)) == []
    pipe = KVPipeline.from_preset("frontier-2bit", residual=16)
    measured = measure(pipe.for_model(model), model, IDS, progress=False)
    tuned, report = tuned_for_model(measured, model, 2.5)
    assert report["full_layers"] == full
    assert stored_bits(report).endswith(f"({report['full_layer_bits_per_value']:.4g} in the layers without a sliding "
                                        "window)")
    assert stored_bits({"bits_per_value": 2.5}) == "2.5 stored bits per value"
    assert report["bits_per_value"] <= 2.5 + 1e-9 and report["full_layer_bits_per_value"] <= 2.5 + 1e-9
    assert tuned_pipeline(measured, 2.5)[1]["predicted_kl"] <= report["predicted_kl"] + 1e-12  # one bound fewer
    tuned.compile = False
    with torchkv.patched(model, tuned), torch.no_grad():
        cache = torchkv.new_cache(model)
        model(IDS[:1], **cache_argument(model, cache))
        held = [layer.store.length for layer in cache.layers]
        assert min(held[i] for i in full) > 2 * max(n for i, n in enumerate(held) if i not in full)
        assert cache.encoded_bits_per_value() <= 2.5 + 1e-9


def test_sampled_calibration_windows_start_at_bos_and_repeat_with_their_seed():
    """`benchmarks/generated_calibration.py`: the model's own windows are `[windows, seq_len]`, each started from the
    BOS token with no end-of-text after it, and the same seed gives the same windows (another seed, others)."""
    from pathlib import Path
    from types import SimpleNamespace

    from torchkv.testing import load_script, tiny_model

    root = Path(__file__).resolve().parents[2]
    module = load_script(root / "benchmarks/generated_calibration.py")
    model = tiny_model()
    tokenizer = SimpleNamespace(bos_token_id=1, eos_token_id=2)
    ids = module.sampled_windows(model, tokenizer, windows=5, seq_len=24, seed=0, batch=2)
    assert ids.shape == (5, 24) and (ids[:, 0] == 1).all() and (ids[:, 1:] != 2).all()
    assert torch.equal(ids, module.sampled_windows(model, tokenizer, windows=5, seq_len=24, seed=0, batch=2))
    assert not torch.equal(ids, module.sampled_windows(model, tokenizer, windows=5, seq_len=24, seed=1, batch=2))
