"""`benchmarks/gpu_decode.py` on the CPU with its tiny shape: every row measured, its files written, the random-weights
note kept (the compiled rows compile for minutes on a CPU, and are left to the GPU run)."""

import json
from pathlib import Path

import pytest
import torch

import torchkv
from torchkv.models import arch, cache_argument
from torchkv.ops import triton_decode
from torchkv.testing import load_script, tiny_model

gpu_decode = load_script(Path(__file__).parents[1] / "benchmarks" / "gpu_decode.py")


def test_gpu_decode_benchmark_runs_on_the_cpu_and_writes_its_files(tmp_path, capsys, monkeypatch):
    sweep = tmp_path / "sweep" / "kernel_sweep.json"  # the best launch settings of a kernel sweep are applied
    sweep.parent.mkdir()
    sweep.write_text(json.dumps({"best": {"settings": {"BLOCK_T": 64, "NUM_WARPS": 4}}}))
    for name in ("BLOCK_T", "NUM_WARPS"):
        monkeypatch.setattr(triton_decode, name, getattr(triton_decode, name))  # restored after the test
    path = gpu_decode.main(["--cells", "tiny:1x96", "--rows", "dynamic,kivi-2bit", "--device", "cpu",
                            "--dtype", "float32", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "run"),
                            "--kernel-settings", str(sweep)])
    results = json.loads(path.read_text())
    assert sorted(p.suffix for p in (tmp_path / "run").iterdir()) == [".json", ".md", ".png"]
    assert results["meta"]["kernel_settings"]["BLOCK_T"] == 64 and results["meta"]["kernel_settings"]["NUM_WARPS"] == 4
    assert results["meta"]["finished"] and results["meta"]["random_weights"] == gpu_decode.RANDOM_WEIGHTS
    assert "random" in results["meta"]["random_weights"] and results["meta"]["copy_bandwidth_bytes_per_s"] > 0
    rows = {r["row"]: r for r in results["rows"]}
    assert list(rows) == [gpu_decode.FP16_LIMIT, "dynamic", "kivi-2bit"]
    for name in ("dynamic", "kivi-2bit"):
        row = rows[name]
        assert "error" not in row, row.get("error")
        assert (row["shape"], row["batch"], row["context"]) == ("tiny", 1, 96)
        assert row["ms_per_step"] > 0 and row["cache_bytes"] > 0
        assert row["prefill_ms"] > 0 and row["first_prefill_ms"] > 0
        assert row["graphs_compiled"]["prefill"] == 0  # the first prefill at the cell's size ran what compiles
        assert row["bytes_per_step"] > row["cache_bytes"] and 0 < row["fraction_of_copy_bandwidth"]
        assert row["x_dynamic"] > 0 and "x_static_compiled" not in row
    assert rows["dynamic"]["x_dynamic"] == 1.0 and rows["dynamic"]["prefill_x_dynamic"] == 1.0
    fp16 = rows[gpu_decode.FP16_LIMIT]
    config = gpu_decode.LlamaConfig(**gpu_decode.SHAPES["tiny"])
    assert fp16["cache_bytes"] == 2 * 2 * 1 * 2 * 64 * 96 * 2 == gpu_decode.fp16_cache_bytes(config, 1, 96)
    table = path.with_suffix(".md").read_text()
    assert "## tiny batch 1 x 96 tokens" in table and "| kivi-2bit | " in table and "random" in table
    assert "| kivi-2bit | " in capsys.readouterr().out


def test_rows_past_the_deadline_are_recorded_as_skipped(tmp_path):
    path = gpu_decode.main(["--cells", "tiny:1x8", "--rows", "dynamic", "--device", "cpu", "--dtype", "float32",
                            "--steps", "1", "--deadline-seconds", "0", "--out", str(tmp_path)])
    rows = json.loads(path.read_text())["rows"]
    assert [(r["row"], r.get("skipped")) for r in rows] == [
        (gpu_decode.FP16_LIMIT, None), ("dynamic", "skipped: deadline")]


def test_cells_parse_and_the_fp16_limit_counts_the_bytes_a_step_reads():
    assert gpu_decode.parse_cells("1b:1x4096,8b:8x32768") == [("1b", 1, 4096), ("8b", 8, 32768)]
    for bad in ("3b:1x4096", "1b:4096", "1b:1x"):
        with pytest.raises(ValueError, match="SHAPE:BATCHxCONTEXT"):
            gpu_decode.parse_cells(bad)
    config = gpu_decode.LlamaConfig(**gpu_decode.SHAPES["8b"])
    assert gpu_decode.fp16_cache_bytes(config, 8, 32768) == 2 * 32 * 8 * 8 * 128 * 32768 * 2  # 34.4 GB
    model = gpu_decode.build_model("tiny", torch.device("cpu"), torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16 and model.config._attn_implementation == "sdpa"
    params = sum(p.numel() for p in model.parameters())
    assert gpu_decode.weight_bytes_read(model) == 2 * params  # tied embeddings: the table is read by the head


def test_a_prompt_fed_in_chunks_compiles_nothing_in_its_timed_prefill(monkeypatch):
    """The warm-up runs a prompt piece over encoded history (what every chunk after a long prompt's first does), so the
    timed prefill of a long prompt reuses its graphs: a graph compiled there would be timed as prefill."""
    monkeypatch.setattr(gpu_decode, "PREFILL_CHUNK", 128)
    model = gpu_decode.build_model("tiny", torch.device("cpu"), torch.float32)
    row = gpu_decode.measure_row(model, "kivi-2bit", batch=1, context=512, steps=1, warmup=1)
    assert row["prefill_chunk"] == 128
    assert row["graphs_compiled"]["prefill"] == 0, row["graphs_compiled"]


def test_a_kernel_row_without_one_encoded_chunk_is_refused_with_the_context_it_needs():
    with pytest.raises(ValueError, match=r"kivi-2bit needs a context of at least 160 tokens .* not 96"):
        gpu_decode.kernel_row("kivi-2bit", 96, 1, torch.device("cpu"))


def test_profile_decode_profiles_a_random_weights_shape_without_smollm2(tmp_path):
    profile_decode = load_script(Path(__file__).parents[1] / "benchmarks" / "profile_decode.py")
    out = tmp_path / "profile.json"
    result = profile_decode.main(["--shape", "tiny", "--preset", "kivi-2bit", "--context", "300", "--batch", "2",
                                  "--steps", "2", "--top", "40", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert (result["model"], result["batch"], result["device"]) == ("tiny", 2, "cpu")
    assert len(result["top"]) == 40 and result["self_cpu_ms_per_step"] > 0 and result["self_device_ms_per_step"] is None
    assert all(op["calls_per_step"] > 0 and op["ms_per_step"] > 0 for op in result["top"])
    # each Inductor kernel an event of its own on the CPU, and the setting left as it was
    assert any("cpp_fused" in op["op"] for op in result["top"])
    assert not torch._inductor.config.cpp.enable_kernel_profile


def test_a_tuned_folder_is_placed_on_a_shape_by_relative_depth_and_head_index_and_decodes():
    """The recommended per-head folder (SmolLM2: 30 layers, 3 KV heads) on 16 layers of 8 KV heads: layer i takes
    the folder's layer round(i·29/15), KV head h the widths of head h mod 3; the model generates through it."""
    source = json.loads((gpu_decode.TUNED_FOLDER / "torchkv_config.json").read_text())
    model = tiny_model("llama", heads=8, kv_heads=8, layers=16, head_dim=32)
    pipe = gpu_decode.on_shape(gpu_decode.TUNED_FOLDER, model)
    assert pipe.tuned_for == arch.fingerprint(model)
    for layer in range(16):
        keys, values = pipe.layer_chains[layer]
        wanted = source["layers"][str(round(layer * 29 / 15))]
        for side, spec in (("keys", keys), ("values", values)):
            groups = wanted[side]["heads"] if isinstance(wanted[side], dict) else [[0, 1, 2]]
            chains = wanted[side]["chains"] if isinstance(wanted[side], dict) else [wanted[side]]
            width = {h: chains[next(i for i, g in enumerate(groups) if h % 3 in g)] for h in range(8)}
            held = {h: c.spec() for heads, c in zip(spec.heads, spec.chains) for h in heads} if hasattr(
                spec, "heads") else dict.fromkeys(range(8), spec.spec())
            assert held == width, (layer, side)
    pipe.compile = False
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    with torchkv.patched(model, pipe):
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 204)


@torch.no_grad()
def test_the_centred_2_1_bit_folder_decodes_on_fixed_buffers_on_a_shape():
    """`--tuned` with the ≤ 2.1-bit recipe (keys centred by a turned centre in some heads) placed on a Llama shape:
    its cache takes fixed-capacity buffers, so `compiled:tuned` times the whole step, and it decodes there what the
    growing cache decodes."""
    folder = gpu_decode.TUNED_FOLDER.parent / "frontier-2bit@2.1_mixed_per_head_far_either_centre"
    model = tiny_model("llama", heads=8, kv_heads=8, layers=16, head_dim=32)
    pipe = gpu_decode.on_shape(folder, model)
    assert any(pipe.for_layer(i).codec.attention_rope == "chunks" for i in range(16))
    pipe.compile = False
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    with torchkv.patched(model, pipe):
        growing = model.generate(ids, max_new_tokens=40, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        cache = torchkv.new_cache(model, max_cache_len=256)
        static = model.generate(ids, max_new_tokens=40, do_sample=False, output_scores=True,
                                return_dict_in_generate=True, **cache_argument(model, cache))
    assert cache.is_compileable and all(layer.frozen for layer in cache.layers)
    assert cache.layers[0].held.n_encoded == 3 * 32  # 2 chunks from the prompt, 1 flushed during decode
    torch.testing.assert_close(torch.stack(static.scores), torch.stack(growing.scores), rtol=1e-4, atol=1e-4)


def test_a_tuned_row_without_a_tuned_folder_is_refused_before_measuring(tmp_path):
    with pytest.raises(ValueError, match="no pipeline tuned for a model is saved there"):
        gpu_decode.main(["--cells", "tiny:1x8", "--rows", "dynamic,compiled:tuned", "--device", "cpu", "--dtype",
                         "float32", "--tuned", str(tmp_path), "--out", str(tmp_path)])
