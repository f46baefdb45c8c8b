"""The evaluation harness on the real model, with small samples."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from torchkv.eval import runner
from torchkv.corpora import DOMAINS, MIXED, SPLITS, documents, domain, split_articles, split_text, token_stream
from torchkv.eval.perplexity import perplexity
from torchkv.eval.report import markdown_table, pareto_points, plots, tuned_curves
from torchkv.eval.retrieval import cases, retrieval
from torchkv.eval.rows import cache_nbytes, method
from torchkv.eval.runner import EvalSettings, run_eval
from torchkv.models import cache_argument

# the harness is the subject: compile='auto' runs as in a user's short evaluation, eagerly
pytestmark = [pytest.mark.model, pytest.mark.eager_first]


def test_splits_are_fixed_and_disjoint():
    ev, cal = split_articles("eval"), split_articles("calibration")
    assert len(ev) > 500 and len(cal) > 2 * len(ev)
    assert not {t for t, _ in ev} & {t for t, _ in cal}
    assert ev[0][0] == sorted(t for t, _ in ev)[0]
    with pytest.raises(ValueError, match="unknown split 'test'"):
        split_articles("test")
    assert set(SPLITS) == {"eval", "calibration"}


@pytest.mark.parametrize("name", list(DOMAINS))
def test_every_domain_has_fixed_disjoint_splits_with_room_for_long_contexts(smollm2, name):
    _, tokenizer = smollm2
    ev, cal = split_articles("eval", name), split_articles("calibration", name)
    assert not {t for t, _ in ev} & {t for t, _ in cal} and len(cal) > len(ev) > 10
    assert token_stream(tokenizer, "eval", name).numel() >= 4 * 8192  # 8K documents and haystacks, several seeds
    assert token_stream(tokenizer, "calibration", name).numel() >= 32768  # the default calibration sample
    assert documents(tokenizer, 64, 1, domain_name=name).shape == (1, 64)


def test_the_mixed_domain_takes_every_domain_in_turn_from_its_own_split():
    mixed = split_articles("calibration", MIXED)
    assert [name.split(":")[0] for name, _ in mixed[:6]] == [*DOMAINS, *DOMAINS]  # any prefix holds each domain
    text = "".join(t for _, t in mixed)
    assert len(text) == sum(len(split_text("calibration", d)) for d in DOMAINS)
    for name in DOMAINS:  # pieces of the calibration splits only: nothing of an evaluation split
        pieces = "".join(t for n, t in mixed if n.startswith(name + ":"))
        assert pieces == split_text("calibration", name)


def test_a_mix_of_some_domains_leaves_the_others_out():
    """`mixed:wiki,code`: what `mixed` holds of wiki and code, in turn, and nothing of docs (calibrate on two domains,
    evaluate on the third)."""
    mixed = split_articles("calibration", "mixed:wiki,code")
    assert [name.split(":")[0] for name, _ in mixed[:4]] == ["wiki", "code", "wiki", "code"]
    assert {name.split(":")[0] for name, _ in mixed} == {"wiki", "code"}
    assert [doc for doc in split_articles("calibration", MIXED) if not doc[0].startswith("docs:")] == list(mixed)
    assert "wiki, code" in domain("mixed:wiki,code").description
    for bad in ("mixed:wiki", "mixed:wiki,wiki", "mixed:wiki,legal", "mixed:"):
        with pytest.raises(ValueError, match="a mix names two or more of wiki, code, docs, each once"):
            split_articles("calibration", bad)


def test_an_unknown_domain_lists_the_available_ones():
    with pytest.raises(ValueError, match="unknown domain 'legal'; available: wiki .*; code .*; docs .*; mixed"):
        split_articles("eval", "legal")
    with pytest.raises(ValueError, match="unknown domain 'legal'"):
        EvalSettings(domains=("wiki", "legal"))


def test_blockwise_perplexity_through_dynamic_cache_equals_one_forward(smollm2):
    model, tokenizer = smollm2
    docs = documents(tokenizer, 512, 1)
    with torch.no_grad():
        logits = model(docs).logits[0, :-1]
    direct = math.exp(float(torch.nn.functional.cross_entropy(logits, docs[0, 1:])))
    assert perplexity(model, docs, method("dynamic"), progress=False) == pytest.approx(direct, rel=1e-4)


def test_perplexity_modes_order(smollm2):
    model, tokenizer = smollm2
    docs = documents(tokenizer, 512, 1)
    full = perplexity(model, docs, method("dynamic"), progress=False)
    fp16 = perplexity(model, docs, method("fp16"), progress=False)
    row = method("kivi-2bit")
    streaming = perplexity(model, docs, row, progress=False)
    simulated = perplexity(model, docs, row, simulated=True, progress=False)
    assert fp16 == pytest.approx(full, rel=1e-3)
    assert full < streaming < simulated


def test_retrieval_cases_are_seeded_and_scored(smollm2):
    model, tokenizer = smollm2
    a, b = cases(tokenizer, 600, 3, seed=1), cases(tokenizer, 600, 3, seed=1)
    assert [c.key for c in a] == [c.key for c in b] and all(c.prompt.shape == (1, 600) for c in a)
    assert tokenizer.decode(a[0].answer) == " " + a[0].key
    assert a[0].key in tokenizer.decode(a[0].prompt[0, :20])
    scores = retrieval(model, a, [method("dynamic"), method("kivi-2bit")], progress=False)
    full, broken = scores["dynamic"], scores["kivi-2bit"]
    assert full["cases"] == 3 and full["accuracy"] >= 2 / 3 and full["logprob"] > -3
    assert broken["logprob"] < full["logprob"]


def test_a_filled_cache_holds_what_a_patched_prefill_stores(smollm2):
    """Retrieval's shared prompt pass: filling a cache from captured tensors stores the same bytes as
    running the prompt through the patched model."""
    from torchkv.models.capture import capture_qkv

    model, tokenizer = smollm2
    ids = documents(tokenizer, 300, 1)
    row = method("squat-2bit")
    with row.active(model), torch.no_grad():
        through_model = row.new_cache(model)
        model(ids, **cache_argument(model, through_model))
    filled = row.filled_cache(model, capture_qkv(model, ids)[1])
    for a, b in zip(through_model.layers, filled.layers):
        held_a, held_b = a.store.tensors(), b.store.tensors()
        assert held_a.keys() == held_b.keys()
        for name in held_a:  # codes may flip where a value sits on a rounding boundary
            assert (held_a[name].float() - held_b[name].float()).abs().mean() < 1e-3, name


def test_cache_bytes_of_baselines(smollm2):
    model, tokenizer = smollm2
    ids = documents(tokenizer, 600, 1)
    sizes = {}
    for name in ("dynamic", "quanto-4bit", "kivi-4bit"):
        row = method(name)
        with row.active(model), torch.no_grad():
            cache = row.new_cache(model)
            model(ids, **cache_argument(model, cache))
            sizes[name] = cache_nbytes(cache)
    assert sizes["dynamic"] == 600 * 30 * 2 * 3 * 64 * 4
    assert sizes["quanto-4bit"] < sizes["dynamic"] / 3 and sizes["kivi-4bit"] < sizes["dynamic"] / 2


def test_run_eval_writes_rows_as_they_finish(tmp_path, monkeypatch):
    settings = EvalSettings(ppl_docs={256: 1}, retrieval_contexts=(256,), retrieval_cases=1, speed_contexts=(256,),
                            new_tokens=2)
    real = runner.evaluate_row

    def fail_on_quanto(model, tokenizer, row, *args):
        if row.name == "quanto-2bit":
            raise KeyboardInterrupt
        return real(model, tokenizer, row, *args)

    monkeypatch.setattr(runner, "evaluate_row", fail_on_quanto)
    out = tmp_path / "r.json"
    with pytest.raises(KeyboardInterrupt):
        run_eval("smollm2-135m", ["kivi-4bit", "quanto-2bit"], settings, out, progress=False)
    saved = json.loads(out.read_text())
    assert [r["name"] for r in saved["rows"]] == ["dynamic", "kivi-4bit"]
    row = saved["rows"][1]
    assert row["bits_per_value"] == {"keys": 5.0, "values": 5.0}
    assert set(row["ppl"]["streaming"]) == {"256"} and row["retrieval"]["256"]["cases"] == 1
    gen = row["generation"][0]
    assert gen["decode_tokens_per_s"] > 0 and gen["cache_bytes"] > 0 and gen["peak_rss_bytes"] > 0
    assert saved["meta"]["machine"]["cpu_count"] and saved["meta"]["torch"] and saved["meta"]["settings"]["seed"] == 0
    table = markdown_table(saved)
    assert "| kivi-4bit |" in table and "(+" in table
    assert "Held-out text by domain" in table and "tuned on the calibration split" not in table  # no tuned row
    tuned = {**saved, "rows": [*saved["rows"], {**row, "name": "tuned:kivi-2bit@2.5"}]}
    assert f"tuned on the calibration split of {saved['meta']['settings']['tune_domain']}." in markdown_table(tuned)
    assert "Pareto" in table and "| kivi-4bit |" in table.split("Pareto")[1]
    written = plots(saved, tmp_path, "e")
    assert {p.name for p in written} == {"e_ppl_vs_bits.png", "e_decode_speed.png", "e_pareto.png"}
    assert all(p.stat().st_size > 10_000 for p in written)


def test_bad_requests_are_refused_before_work():
    with pytest.raises(ValueError, match="'calibration' is the calibration split"):
        EvalSettings(split="calibration")
    with pytest.raises(ValueError, match="unknown preset 'kivi-9bit'"):
        run_eval("smollm2-135m", ["kivi-9bit"], EvalSettings(), None, progress=False)
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        run_eval("gpt-5", ["kivi-4bit"], EvalSettings(), None, progress=False)
    with pytest.raises(ValueError, match="context 16384 exceeds smollm2-135m's limit of 8192"):
        run_eval("smollm2-135m", ["kivi-4bit"], EvalSettings(ppl_docs={16384: 1}), None, progress=False)


def _row(name, bits, increase, speed):
    tokens = 100
    return {"name": name, "kind": "torchkv", "ppl": {"streaming": {"2048": 10 * (1 + increase / 100)}},
            "generation": [{"context": tokens, "batch": 1, "new_tokens": 1, "decode_tokens_per_s": speed,
                            "cache_bytes": bits * tokens / 8}]}


def test_pareto_marks_frontiers_and_rows_ahead_on_both():
    rows = [_row("dynamic", 16, 0, 10), _row("a", 2, 5, 12), _row("b", 3, 1, 9), _row("c", 3, 4, 8),
            _row("d", 4, 0.5, 15)]
    results = {"meta": {"reference": "dynamic", "values_per_token": 1}, "rows": rows}
    points = {p["name"]: p for p in pareto_points(results)}
    assert set(points) == {"a", "b", "c", "d"}
    assert [n for n, p in points.items() if p["quality_frontier"]] == ["a", "b", "d"]
    assert [n for n, p in points.items() if p["speed_frontier"]] == ["a", "d"]
    assert points["c"]["dominated_by"] == ["b"] and points["b"]["dominated_by"] == []
    assert abs(points["a"]["bits"] - 2) < 1e-9 and abs(points["d"]["decode_ratio"] - 1.5) < 1e-9


def test_tuned_rows_are_drawn_as_one_curve_per_starting_row(tmp_path):
    rows = [_row("dynamic", 16, 0, 10), _row("kivi-2bit", 3, 13, 9), _row("tuned:kivi-2bit@3", 3, 4, 9),
            _row("tuned:kivi-2bit@2", 2, 9, 9), _row("tuned:frontier-2bit@2", 2, 2, 10)]
    results = {"meta": {"reference": "dynamic", "values_per_token": 1, "model": "m", "machine": {"cpu_count": 2}},
               "rows": rows}
    curves = tuned_curves([(p["name"], p["bits"], p["ppl_increase"]) for p in pareto_points(results)])
    assert curves == {"kivi-2bit": [(pytest.approx(2), pytest.approx(9)), (pytest.approx(3), pytest.approx(4))],
                      "frontier-2bit": [(pytest.approx(2), pytest.approx(2))]}
    first = plots(results, tmp_path, "first")
    # a second results file written to the same folder keeps the first one's plots
    second = plots({**results, "rows": rows[:2]}, tmp_path, "second")
    assert {p.name for p in first} == {"first_ppl_vs_bits.png", "first_decode_speed.png", "first_pareto.png"}
    assert {p.name for p in second} == {"second_ppl_vs_bits.png", "second_decode_speed.png", "second_pareto.png"}
    assert all(p.is_file() for p in first) and [p.read_bytes() for p in first] != [p.read_bytes() for p in second]


def test_a_speed_only_run_reports_its_speed_without_perplexity_plots(tmp_path):
    """`torchkv eval --ppl-docs none` (a committed run of it): no streaming perplexity, so no perplexity plot and
    no Pareto table, and the speed is still reported."""
    committed = Path(__file__).parents[2] / "benchmarks/results/frontier/eval_smollm2_speed.json"
    results = json.loads(committed.read_text())
    assert results["meta"]["settings"]["ppl_docs"] == {}
    table = markdown_table(results)
    assert pareto_points(results) == [] and "Pareto" not in table and "| frontier-2bit |" in table
    assert [p.name for p in plots(results, tmp_path, "speed")] == ["speed_decode_speed.png"]


def test_a_model_with_sliding_layers_reports_the_full_layers_bits_beside_the_mean():
    """A per-layer pipeline on a model whose sliding-window layers hold at most their window: the row records the
    mean bits over its full layers, what the cache's bits per value tend to past the window, and the table shows
    it after the mean over layers."""
    from torchkv.pipeline import KVPipeline
    from torchkv.testing import tiny_model

    model = tiny_model("gemma3_text", layers=2, sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    base = KVPipeline.from_preset("kivi-2bit", residual=16)
    wide = KVPipeline.from_preset("kivi-4bit", residual=16)
    pipe = KVPipeline(base.keys, base.values, layers={1: (wide.keys, wide.values)}, residual=16, sinks=base.sinks,
                      chunk=base.chunk)
    row = method("kivi-2bit")
    row.pipeline = pipe
    settings = EvalSettings(ppl_docs={}, retrieval_contexts=(), speed_contexts=())
    measured = runner.evaluate_row(model, None, row, settings, {}, progress=False)
    mean, full = (measured[key]["keys"] for key in ("bits_per_value", "full_layer_bits_per_value"))
    assert full == pytest.approx(5.0) and mean == pytest.approx((3.0 + 5.0) / 2)
    plain = runner.evaluate_row(tiny_model("llama", layers=2), None, row, settings, {}, progress=False)
    assert "full_layer_bits_per_value" not in plain
    results = {"meta": {"reference": "dynamic", "values_per_token": 1, "model": "m", "dtype": "float32",
                        "torch": "t", "transformers": "t", "machine": {"cpu": "c", "cpu_count": 2},
                        "settings": dataclasses.asdict(settings)},
               "rows": [{"name": "dynamic", "kind": "dynamic", "ppl": {"streaming": {}}}, measured]}
    table = markdown_table(results)
    assert "| 4.00 / 5.00 |" in table and "tend to the second past it" in table
