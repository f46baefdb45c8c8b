"""The long-context runners and their reports on the real SmolLM2, at 320-token contexts with one sample."""

import json

import pytest

from torchkv.cli import main
from torchkv.eval import long_context, long_report
from torchkv.eval.long_context import run_needle, run_suite

# the harness is the subject: compile='auto' runs as in a user's short evaluation, eagerly
pytestmark = [pytest.mark.model, pytest.mark.eager_first]

TOO_LONG = 16384  # SmolLM2 has 8192 positions
REASON = f"smollm2-135m has 8192 positions; a {TOO_LONG}-token context does not fit"


@pytest.fixture
def calls(smollm2, monkeypatch):
    """The names of the through-cache calls the runners make; the runners load the session's SmolLM2."""
    monkeypatch.setattr(long_context, "_load", lambda name: smollm2)
    made = []
    for name in ("score", "generate"):
        real = getattr(long_context, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            made.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(long_context, name, counted)
    return made


def test_suite_skips_what_does_not_fit_resumes_and_reports(calls, tmp_path, capsys):
    out = tmp_path / "suite.json"
    results = run_suite("smollm2-135m", ["dynamic"], ["niah_single"], [320, TOO_LONG], 1, out, progress=False)
    assert calls == ["generate"]  # nothing for the skipped length
    cells = results["cells"]
    assert [(c["preset"], c["task"], c["length"], c.get("skipped")) for c in cells] == [
        ("dynamic", "niah_single", 320, None), ("dynamic", "niah_single", TOO_LONG, REASON)]
    assert capsys.readouterr().out.count(REASON) == 1
    cell = cells[0]
    assert cell["accuracy"] == 1 and cell["by_seed"] == [1]  # full precision finds one needle in 320 tokens
    assert cell["samples"] == 1 and cell["seconds"] > 0
    assert json.loads(out.read_text()) == results
    meta = results["meta"]
    assert (meta["kind"], meta["model"], meta["reference"]) == ("long-suite", "smollm2-135m", "dynamic")

    calls.clear()  # a rerun on the same file does no new work, and writes the report beside it
    main(["eval", "--suite", "long", "--presets", "dynamic", "--tasks", "niah_single", "--lengths",
          f"320,{TOO_LONG}", "--samples", "1", "--out", str(out), "--no-progress"])
    assert calls == []
    assert json.loads(out.read_text())["cells"] == cells
    table = (tmp_path / "suite.md").read_text()
    assert "| preset | niah_single 320 | mean 320 | niah_single 16384 | mean 16384 |" in table
    assert "| dynamic | 1.00 | 1.00 | skip | skip |" in table and REASON in table
    assert (tmp_path / "suite.png").stat().st_size > 0


def test_needle_grid_puts_the_reference_first_is_scored_only_and_drawn(calls, tmp_path):
    out = tmp_path / "needle.json"
    results = run_needle("smollm2-135m", ["kivi-2bit"], [TOO_LONG, 320], [0.5], 1, out, progress=False)
    assert calls == ["score", "score"]
    assert [(c["preset"], c["length"], c["depth"], "skipped" in c) for c in results["cells"]] == [
        ("dynamic", 320, 0.5, False), ("dynamic", TOO_LONG, 0.5, True),
        ("kivi-2bit", 320, 0.5, False), ("kivi-2bit", TOO_LONG, 0.5, True)]
    run = [c for c in results["cells"] if "skipped" not in c]
    assert all(c["accuracy"] in (0, 1) and c["logprob"] < 0 and c["domain"] == "wiki" for c in run)
    assert all(c["by_seed"] == [{"found": bool(c["accuracy"]), "logprob": c["logprob"]}] for c in run)
    paths = long_report.plots(results, tmp_path, "needle")
    assert [p.name for p in paths] == ["needle_accuracy.png", "needle_logprob.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    table = long_report.markdown_table(results)
    assert "| preset | 320 | 16384 | mean | mean logprob |" in table
    assert [line.split(" |")[0] for line in table.splitlines() if line.startswith("| ") and "skip" in line] == [
        "| dynamic", "| kivi-2bit"]

    calls.clear()  # another domain joins the same file: only its cells run, and each domain is reported apart
    main(["eval", "--needle", "--presets", "kivi-2bit", "--lengths", f"{TOO_LONG},320", "--depths", "50",
          "--samples", "1", "--domains", "wiki,code", "--out", str(out), "--no-progress"])
    assert calls == ["score", "score"]
    cells = json.loads(out.read_text())["cells"]
    assert [(c["preset"], c["domain"], c["length"]) for c in cells if "skipped" not in c] == [
        ("dynamic", "wiki", 320), ("dynamic", "code", 320), ("kivi-2bit", "wiki", 320), ("kivi-2bit", "code", 320)]
    table = (tmp_path / "needle.md").read_text()
    assert table.count("| preset | 320 | 16384 | mean | mean logprob |") == 2
    assert "the 'wiki' domain" in table and "the 'code' domain" in table
    assert (tmp_path / "needle_code_accuracy.png").stat().st_size > 0


def test_tuned_rows_are_tuned_on_the_named_domain_and_the_run_records_it(calls, tmp_path, monkeypatch):
    from torchkv.eval.rows import Method

    tuned_on = []

    def tune_for(self, model, tokenizer, tokens, out_dir, progress=True, domain="wiki"):
        tuned_on.append(domain)  # the real tuning takes minutes: the row keeps its starting pipeline
        self.pipeline = self.tuning[0].pipeline

    monkeypatch.setattr(Method, "tune_for", tune_for)
    out = tmp_path / "needle.json"
    main(["eval", "--needle", "--presets", "tuned:kivi-2bit@2.5", "--lengths", "320", "--depths", "50", "--samples",
          "1", "--tune-domain", "code", "--out", str(out), "--no-progress"])
    assert tuned_on == ["code"] and calls == ["score", "score"]
    assert json.loads(out.read_text())["meta"]["settings"] == {"samples": 1, "tune_domain": "code"}
    plain = run_needle("smollm2-135m", ["kivi-2bit"], [320], [0.5], 1, tmp_path / "plain.json", progress=False,
                       tune_domain="code")
    assert plain["meta"]["settings"] == {"samples": 1}  # no tuned row: nothing tuned, nothing recorded


def test_bad_input_is_refused_with_the_next_step(calls, tmp_path, capsys):
    out = tmp_path / "x.json"
    with pytest.raises(ValueError, match="unknown tasks \\['niah'\\]; the tasks are: niah_single, niah_multikey"):
        run_suite("smollm2-135m", ["kivi-2bit"], ["niah"], [320], 1, out, progress=False)
    with pytest.raises(ValueError, match="unknown domain 'news'; available: wiki"):
        run_needle("smollm2-135m", ["kivi-2bit"], [320], [0.5], 1, out, progress=False, domains=["news"])
    with pytest.raises(ValueError, match="unknown domain 'news'; available: wiki"):
        run_suite("smollm2-135m", ["tuned:kivi-2bit@2.5"], ["niah_single"], [320], 1, out, progress=False,
                  tune_domain="news")
    with pytest.raises(ValueError, match="depths are fractions .* got \\[50.0\\]"):
        run_needle("smollm2-135m", ["kivi-2bit"], [320], [50.0], 1, out, progress=False)
    with pytest.raises(ValueError, match="`torchkv calibrate --preset aquakv-2bit --model smollm2-135m --out DIR`, "
                                         "then pass DIR as the preset"):
        run_needle("smollm2-135m", ["aquakv-2bit"], [320], [0.5], 1, out, progress=False)
    out.write_text(json.dumps({"meta": {"kind": "needle", "model": "other", "settings": {"samples": 1}}, "cells": []}))
    with pytest.raises(ValueError, match="needle run of other .* pass another --out"):
        run_needle("smollm2-135m", ["kivi-2bit"], [320], [0.5], 1, out, progress=False)
    assert calls == []
    with pytest.raises(SystemExit):
        main(["eval", "--lengths", "320", "--out", str(out)])
    assert "--lengths apply to the long-context runs only: add --suite long or --needle" in capsys.readouterr().err
