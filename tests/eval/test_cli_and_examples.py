"""The command line, the examples and the README, run as a user would."""

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import torchkv
from torchkv.cli import main
from torchkv.testing import load_script

ROOT = Path(__file__).resolve().parents[2]
#: as a user runs them: compile='auto' runs its first calls eagerly
pytestmark = pytest.mark.eager_first


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture
def script(capsys):
    """`script(PATH, *ARGS)`: what `python PATH ARGS` prints, run in this process (its `main`, without a fresh
    interpreter's ~7 s of imports; `test_module_entry_point` starts one)."""

    def run(path: str, *args: str) -> str:
        module = load_script(ROOT / path)
        capsys.readouterr()
        module.main(list(args))
        return capsys.readouterr().out

    return run


def test_presets_command_lists_the_registry(capsys):
    main(["presets"])
    out = capsys.readouterr().out
    for p in torchkv.presets():
        assert re.search(rf"^{re.escape(p['name'])}\s+{p['nominal_bits']:g} bits\s+{re.escape(p['description'])}$", out, re.M)


def test_errors_exit_with_a_message(capsys, tmp_path):
    with pytest.raises(SystemExit) as code:
        main(["eval", "--presets", "kivi-3bit", "--out", str(tmp_path / "x.json")])
    assert code.value.code == 2
    assert "unknown preset 'kivi-3bit'" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path / "bad.json")])
    assert "not a torchkv results file" in capsys.readouterr().err


@pytest.mark.model
def test_eval_command_can_skip_retrieval_and_speed(capsys, tmp_path):
    out = tmp_path / "ppl.json"
    main(["eval", "--presets", "kivi-4bit", "--ppl-docs", "256:1", "--retrieval-contexts", "none",
          "--speed-contexts", "none", "--out", str(out), "--no-progress"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["dynamic", "kivi-4bit"]
    assert all(r["retrieval"] == {} and r["generation"] == [] and set(r["ppl"]["streaming"]) == {"256"} for r in rows)
    assert "| kivi-4bit |" in capsys.readouterr().out


@pytest.mark.model
def test_generate_command_takes_a_preset_with_overrides(capsys):
    main(["generate", "Name a colour.", "--preset", "kivi-2bit:residual=16:group=16",
          "--max-new-tokens", "3"])
    assert "[kivi-2bit:residual=16:group=16]" in capsys.readouterr().out


def test_module_entry_point():
    done = _run("-m", "torchkv", "presets")
    assert done.returncode == 0 and "kivi-2bit" in done.stdout


def test_readme_presets_table_is_generated_from_the_registry():
    from torchkv.cli import presets_markdown

    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- presets:begin -->")[1].split("<!-- presets:end -->")[0].strip()
    assert block == presets_markdown().strip(), "regenerate with: python -m torchkv presets --markdown"


@pytest.mark.model
def test_quickstart_example(script):
    out = script("examples/quickstart.py", "--max-new-tokens", "12", "--context-chars", "3000")
    assert re.search(r"KV cache: [\d.]+ MiB -> [\d.]+ MiB \(\d+% saved", out)


@pytest.mark.model
def test_compose_method_example(script):
    out = script("examples/compose_method.py", "--docs", "1", "--length", "512")
    assert "hadamard-2bit" in out and "kivi-2bit" in out


@pytest.mark.model
def test_evaluate_example(tmp_path, script):
    out = tmp_path / "e.json"
    # the quanto baselines' rows are run_eval's (tests/eval/test_eval.py); here they would double the time
    printed = script("examples/evaluate.py", "--context", "256", "--cases", "2", "--presets", "kivi-4bit",
                      "--no-baselines", "--out", str(out))
    assert out.is_file() and (tmp_path / "e_ppl_vs_bits.png").is_file()
    assert "| kivi-4bit |" in printed and "| dynamic |" in printed and "| quanto" not in printed


@pytest.mark.model
def test_frontier_example(script):
    out = script("examples/frontier.py", "--tokens", "384", "--max-new-tokens", "4")
    assert "every layer: keys scored from the stored form; values summed from the stored form" in out
    ppl = {name: float(v) for name, v in re.findall(r"^(\S+): perplexity ([\d.]+)$", out, re.M)}
    assert set(ppl) == {"dynamic", "kivi-2bit", "frontier-2.5bit"}, out
    assert ppl["frontier-2.5bit"] < ppl["kivi-2bit"]
    assert "frontier-2.5bit continues:" in out


@pytest.mark.model
def test_squat_example(script):
    out = script("examples/squat.py", "--tokens", "384", "--max-new-tokens", "4")
    errors = dict(re.findall(r"^(\S+): 3\.00 bits/value, decode queries' mean \|q·δ\| = ([\d.]+)$", out, re.M))
    assert set(errors) == {"kivi-2bit", "squat-2bit"}, out
    assert "squat-2bit continues:" in out


@pytest.mark.model
def test_calibrate_command_saves_a_pipeline_that_eval_rows_and_patch_load(tmp_path, capsys):
    import json

    from torchkv.eval.rows import method

    out = tmp_path / "aquakv"
    main(["calibrate", "--preset", "aquakv-2bit:span=token", "--out", str(out), "--tokens", "512", "--seq-len", "256",
          "--domain", "code", "--no-progress"])
    assert f"wrote {out}" in capsys.readouterr().out
    report = json.loads((out / "calibration.json").read_text())
    assert report["preset"] == "aquakv-2bit:span=token" and report["tokens"] == 512 and len(report["layers"]) == 30
    assert report["domain"] == "code"
    row = method(str(out))
    assert row.pipeline.options["span"] == "token" and row.pipeline.fitted_for["layers"] == 30
    assert row.pipeline.fitted_on == "code" and row.pipeline.tuned_on is None
    with pytest.raises(SystemExit):
        main(["calibrate", "--preset", "kivi-2bit", "--out", str(tmp_path / "kivi")])
    assert "nothing to calibrate" in capsys.readouterr().err


@pytest.mark.model
def test_tune_command_and_tuned_eval_rows_tune_save_and_load(tmp_path, capsys):
    from torchkv.eval.rows import method

    out = tmp_path / "tuned"
    with pytest.raises(SystemExit):  # fewer tokens than one window of the default 2,048
        main(["tune", "--preset", "frontier-2bit", "--budget", "2.125", "--out", str(out), "--tokens", "512"])
    assert "max_tokens=512 is less than one window of seq_len=2048 tokens" in capsys.readouterr().err
    main(["tune", "--preset", "frontier-2bit", "--budget", "2.125", "--out", str(out), "--tokens", "512",
          "--seq-len", "512", "--domain", "docs", "--per-head", "--no-progress",
          "--also", "frontier-2bit:rotary_center=True", "--unbiased-values"])  # the recipe in one command
    assert f"wrote {out}" in capsys.readouterr().out
    report = json.loads((out / "tune.json").read_text())
    assert report["bits_per_value"] <= 2.125 and len(report["layers"]) == 30 and report["tokens"] == 512
    assert report["domain"] == "docs" and report["per_head"] and len(report["head_sensitivity"]) == 30
    assert report["also_presets"] == ["frontier-2bit:rotary_center=True"] and report["unbiased_values"]
    assert any(label.startswith("frontier-2bit:rotary_center=True/") for label in report["sensitivity"][0]["k"])
    saved = method(str(out)).pipeline
    assert saved.tuned_for["layers"] == 30 and saved.tuned_on == "docs" and saved.options["unbiased_values"]
    assert all(t.config.unbiased for prefix, chain in saved.chains() if prefix.endswith("v.")
               for t in chain.transforms if t.kind == "quantize")
    reallocate = load_script(Path(__file__).resolve().parents[2] / "benchmarks/reallocate.py").reallocate
    again = reallocate(out, 2.125, {"k": 1, "v": 1})[1]  # the candidates of both presets, from the report's costs
    widths = [[(layer["keys"], layer["values"]) for layer in r["layers"]] for r in (again, report)]
    assert widths[0] == widths[1] and again["also_presets"] == report["also_presets"]
    for extra, error in ((["--also", "dynamic"], "'dynamic' is a baseline"),
                         (["--also", "frontier-2bit:residual=64"], "keeps other exact tokens than 'frontier-2bit'"),
                         (["--also", "kivi-2bit", "--unbiased-values"],
                          "'kivi-2bit': its values cannot be read unbiased")):  # before the model loads
        with pytest.raises(SystemExit):
            main(["tune", "--preset", "frontier-2bit", "--budget", "2.125", "--out", str(tmp_path / "x"), *extra])
        assert error in capsys.readouterr().err
    results = tmp_path / "eval.json"
    main(["eval", "--presets", "tuned:kivi-2bit@2.75", "--tune-tokens", "512", "--ppl-docs", "128:1",
          "--retrieval-contexts", "none", "--speed-contexts", "none", "--domains", "wiki,code", "--tune-domain", "code",
          "--out", str(results), "--no-progress"])
    rows = json.loads(results.read_text())["rows"]
    assert [r["name"] for r in rows] == ["dynamic", "tuned:kivi-2bit@2.75"]
    tuned = rows[1]
    assert tuned["tuning"]["bits_per_value"] <= 2.75 and tuned["tuning"]["tokens"] == 512
    assert tuned["tuning"]["domain"] == "code" and tuned["config"]["tuned_on"] == "code"
    assert set(tuned["ppl"]["streaming"]) == {"128", "code/128"}  # each domain measured on its own
    table = (tmp_path / "eval.md").read_text()  # printed once and written beside the results, domains named
    assert ("| row | bits/value (cache) | bits/value (encoded) | ppl wiki/128 streaming | ppl code/128 streaming |"
            in table)
    assert "| tuned:kivi-2bit@2.75 (tuned on code) |" in table and "code: Python 3." in table
    assert capsys.readouterr().out.count("| row |") == 1
    assert (tmp_path / "tuned" / "kivi-2bit@2.75" / "tune.json").is_file()  # saved beside the results
    assert (tuned["bits_per_value"]["keys"] + tuned["bits_per_value"]["values"]) / 2 <= 2.75
    with pytest.raises(SystemExit):
        main(["tune", "--preset", "kivi-2bit", "--budget", "1", "--out", str(tmp_path / "x"), "--tokens", "1024"])
    assert "candidate settings reach 1.875 to 9 bits per value" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--preset", "kivi-2bit", "--budget", "2.5", "--out", str(tmp_path / "x"), "--domain", "legal"])
    assert "unknown domain 'legal'; available: wiki" in capsys.readouterr().err


@pytest.mark.model
def test_decode_benchmark_writes_every_cell_and_reports_it(tmp_path, script):
    out = tmp_path / "decode.json"
    # the whole-step compiled rows (static-compiled, compiled:PRESET) compile SmolLM2 for minutes: tested on a tiny
    # model in tests/models/test_static_cache.py
    eager = ("--baselines", "dynamic,quanto-4bit", "--compiled-presets", "")
    script("benchmarks/decode.py", "--contexts", "512", "--batches", "1", "--dtypes", "float32", *eager,
           "--presets", "kivi-4bit", "--new-tokens", "2", "--kernel-presets", "kivi-2bit", "--rounds", "2",
           "--out", str(out))
    script("benchmarks/decode.py", "--append", "--cells", "512x2", "--dtypes", "float32", "--baselines", "dynamic",
           "--compiled-presets", "", "--presets", "", "--new-tokens", "2", "--kernel-presets", "", "--out", str(out))
    results = json.loads(out.read_text())
    assert [(r["name"], r["batch"]) for r in results["rows"]] == [
        ("dynamic", 1), ("quanto-4bit", 1), ("kivi-4bit", 1), ("dynamic", 2),
    ]
    assert len(results["meta"]["runs"]) == 2 and results["rows"][0]["decode_ratio"] == 1.0
    for row in results["rows"][:3]:  # two rounds, in turn: the row's median and its ratios paired by round
        rounds = [r["decode_tokens_per_s"] for r in row["rounds"]]
        assert len(rounds) == 2 and row["decode_tokens_per_s"] == statistics.median(rounds)
    reference = [r["decode_tokens_per_s"] for r in results["rows"][0]["rounds"]]
    kivi = [r["decode_tokens_per_s"] for r in results["rows"][2]["rounds"]]
    assert results["rows"][2]["decode_ratio"] == pytest.approx(statistics.median(k / d for k, d in zip(kivi, reference)))
    assert "rounds" not in results["rows"][3]
    kernel = results["kernel"][0]
    assert kernel["compressed_bytes"] < kernel["fp32_bytes"] / 5 and kernel["torchkv_ms"] > 0
    main(["report", str(out)])
    table = (tmp_path / "decode.md").read_text()
    assert "| kivi-4bit | " in table and "float32 b2 512" in table and "| kivi-2bit | 512 | 1 |" in table
    assert (tmp_path / "decode.png").stat().st_size > 10_000


def test_decode_benchmark_times_the_layers_of_a_tuned_folder_with_their_own_widths():
    """`--kernel-presets FOLDER --kernel-layers 0-3,11`: each layer's compiled pipeline, with the widths the folder
    gave that layer's KV heads (the committed per-head folder: 2-bit keys and 2- and 4-bit values in layer 0, 1-bit
    values in layer 11). A folder made for another layer shape (Gemma 3's) is refused, not timed at SmolLM2's."""
    decode = load_script(ROOT / "benchmarks/decode.py")
    assert decode.layer_list("0-3,11") == [0, 1, 2, 3, 11] and decode.layer_list("7") == [7]
    folder = str(ROOT / "benchmarks/results/domains/tuned/frontier-2bit@2.5_mixed_per_head")

    def value_bits(layer: int) -> set[int]:
        pipe = decode.kernel_pipeline(folder, layer)
        assert pipe.compile is True
        return {t.config.bits for t in pipe.values.transforms if t.kind == "quantize"}

    assert value_bits(0) != value_bits(11) == {1}
    preset = decode.kernel_pipeline("frontier-2.5bit", 0)
    assert preset.residual == 128 and preset.compile is True
    gemma3 = str(ROOT / "benchmarks/results/gemma3/tuned/frontier-2bit@2.5_mixed_either_centre_full_layers")
    refused = "made for layers with kv_heads=1, head_dim=256; this kernel row times kv_heads=3, head_dim=64"
    with pytest.raises(ValueError, match=refused):
        decode.kernel_pipeline(gemma3, 0)


def test_report_of_kernel_rows_alone_is_their_table_without_a_plot(tmp_path, capsys):
    """A decode benchmark run of kernel rows only (`--baselines '' --presets '' --compiled-presets ''`): `torchkv
    report` writes their table, with each row's layer (0 for runs from before layers were timed), and no plot."""
    folder = ROOT / "benchmarks/results/domains/ablations"
    for name, layers in (("attention_by_layer_per_head_2.5_intel.json", "| 8192 | 1 | 29 |"),
                         ("decode_attention_by_width_amd.json", "| frontier-2.5bit | 4096 | 1 | 0 |")):
        results = tmp_path / name
        results.write_text((folder / name).read_text())
        main(["report", str(results)])
        table = results.with_suffix(".md").read_text()
        assert layers in table and "Decode tokens/s" not in table
        assert not list(tmp_path.glob("*.png"))
    capsys.readouterr()


@pytest.mark.model
def test_cold_start_benchmark_times_fresh_processes_and_counts_their_graphs(tmp_path):
    out = tmp_path / "cold.json"
    done = _run("benchmarks/cold_start.py", "--rows", "dynamic,kivi-2bit", "--compile-first", "", "--modes", "cold",
                "--prompt-tokens", "300", "--new-tokens", "4", "--later-tokens", "4", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["row"], r["mode"]) for r in rows] == [("dynamic", "cold"), ("kivi-2bit", "cold")]
    assert rows[1]["graphs_first"] == 0, "compile='auto' compiled within a 4-token generation"
    assert all(r["first_s"] > 0 and r["graphs_after_first"] == 0 for r in rows)
    assert "| kivi-2bit | " in done.stdout
