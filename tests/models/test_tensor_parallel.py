"""torchkv on a tensor-parallel model: `torchrun` ranks load it with transformers' `tp_plan="auto"` (CPU, gloo),
each compressing its own KV heads; greedy generation must equal one device's, token for token.

The ranks run `benchmarks/tensor_parallel.py --no-reference`; the one-device generation is made here.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import torchkv
from torchkv.models.loader import model_path
from torchkv.testing import load_script, tiny_model

WORKER = Path(__file__).resolve().parents[2] / "benchmarks" / "tensor_parallel.py"
worker = load_script(WORKER)
RANKS = 3
#: work per KV head, so a rank's share decodes exactly as on one device
EXACT = ("kivi-4bit", "squat-2bit")
#: need what a rank does not hold: XQuant the whole K/V weights, AQUA-KV's predictors every KV head
REFUSED = {"xquant-2bit": "project.weights rebuilds keys and values", "aquakv-2bit": "predict.linear was calibrated"}
PER_RANK = "svdq-2bit-v4"  # runs with a warning: its SVD basis spans the rank's KV heads only


def run_ranks(model: str, out: Path, presets: list[str], prompt: int, new_tokens: int) -> dict[str, dict]:
    """The tensor-parallel rows of the worker's JSON, by preset."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
               str(WORKER), "--model", model, "--presets", ",".join(presets), "--prompt", str(prompt),
               "--new-tokens", str(new_tokens), "--out", str(out), "--no-reference"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["meta"]["tp_size"] == RANKS
    return {row["preset"]: row["tp"] for row in result["rows"]}


@torch.no_grad()
def one_device(model, preset: str, prompt: torch.Tensor, new_tokens: int) -> tuple[list[int], int]:
    """(greedy tokens, cache bytes) of `preset` on the unsharded model."""
    with torchkv.patched(model, preset):
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             return_dict_in_generate=True)
    return out.sequences[0, prompt.shape[1]:].tolist(), out.past_key_values.nbytes()


def check(rows: dict[str, dict], model, prompt: torch.Tensor, new_tokens: int) -> None:
    with torch.no_grad():
        full = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    assert rows[worker.FULL_PRECISION]["tokens"] == full[0, prompt.shape[1]:].tolist()
    for preset in EXACT:
        tokens, nbytes = one_device(model, preset, prompt, new_tokens)
        assert rows[preset]["tokens"] == tokens, preset
        assert rows[preset]["warnings"] == []
        # each rank holds its third of the heads; only head-independent bookkeeping is repeated
        per_rank = rows[preset]["cache_bytes"]
        assert len(per_rank) == RANKS and max(per_rank) < nbytes / 2, (per_rank, nbytes)
        assert abs(sum(per_rank) - nbytes) <= 0.01 * nbytes, (per_rank, nbytes)
    for preset, reason in REFUSED.items():
        assert "cannot compress a tensor-parallel model's KV cache" in rows[preset]["error"]
        assert reason in rows[preset]["error"]
    if PER_RANK in rows:
        assert len(rows[PER_RANK]["tokens"]) == new_tokens
        assert any("SVD basis spans the rank's KV heads" in w for w in rows[PER_RANK]["warnings"])


def test_tiny_model_generates_as_on_one_device(tmp_path):
    """A random Llama with 6 query and 3 KV heads (head_dim 64), one KV head per rank."""
    model = tiny_model("llama", heads=6, kv_heads=3, hidden_size=192, head_dim=64, intermediate_size=192,
                       vocab_size=192)
    model.save_pretrained(tmp_path / "model")
    rows = run_ranks(str(tmp_path / "model"), tmp_path / "tp.json", [*EXACT, *REFUSED, PER_RANK], 192, 16)
    check(rows, AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval(),
          worker.prompt_ids(tmp_path / "model", 192, 192), 16)


@pytest.mark.slow
def test_smollm2_generates_as_on_one_device(tmp_path):
    """SmolLM2 (9 query heads, 3 KV heads), 192 held-out Wikipedia tokens then 32 greedy ones."""
    rows = run_ranks("smollm2-135m", tmp_path / "tp.json", [*EXACT, *REFUSED], 192, 32)
    model, _ = torchkv.load_model()
    check(rows, model, worker.prompt_ids(model_path(), 192, model.config.vocab_size), 32)
