"""Pipeline folders saved by `save_pretrained` at format version 1 (`tests/fixtures/pipelines_v1/`, written by this
file's `write` before the pipeline's redesign, issue 38) load unchanged: the same decode of a fixed chunk, and the
same config and parameters when saved again. Later code must read what this version wrote.

    python tests/test_format_fixture.py  # writes the folders; run once, at the commit that added them
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchkv
from torchkv.pipeline import CONFIG_FILE, PARAMS_FILE
from torchkv.testing import rope_tables, tiny_model

FIXTURE = Path(__file__).parent / "fixtures" / "pipelines_v1"
#: folder -> preset spelling; the fitted ones are calibrated on a tiny model's random tokens (AQUA-KV: per-layer
#: chains and fitted predictors)
PRESETS = {"kivi-2bit": "kivi-2bit:residual=16:group=16", "squat-2bit": "squat-2bit:residual=16",
           "frontier-2bit": "frontier-2bit:residual=16", "aquakv-2bit": "aquakv-2bit:residual=16"}


def chunk_of(pipe: torchkv.KVPipeline, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [1, 2, chunk, 32] from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, pipe.chunk, 32, generator=g) * 2 + 0.3, torch.randn(1, 2, pipe.chunk, 32, generator=g))


def round_trip(pipe: torchkv.KVPipeline) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's decode of its encoding of `chunk_of(pipe)` (prepared on the same tokens where the pipeline needs)."""
    k, v = chunk_of(pipe)
    g = torch.Generator().manual_seed(2)
    inputs = {"x": torch.randn(1, pipe.chunk, 128, generator=g),
              "queries": torch.randn(1, 4, pipe.chunk, 32, generator=g), **rope_tables(1, pipe.chunk, 32)}
    needed = set(pipe.requires) | ({"queries"} if pipe.needs_prepare else set())
    inputs = {name: t for name, t in inputs.items() if name in needed}
    prepared = pipe.prepare(k, v, inputs=inputs) if pipe.needs_prepare else None
    state = pipe.encode_chunk(k, v, prepared=prepared, inputs=inputs)
    return pipe.decode_chunk(state, head_dim=32, prepared=prepared, inputs=inputs)[:2]


def write() -> None:
    """Save each preset's folder and its expected decode (run once; see the module's docstring)."""
    model = tiny_model(layers=2)
    ids = torch.randint(3, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    for folder, spelling in PRESETS.items():
        pipe = torchkv.KVPipeline.from_preset(spelling, compile=False)
        if pipe.needs_fit:
            pipe.fit(model, ids, seq_len=64, max_tokens=256, progress=False)
        pipe.save_pretrained(FIXTURE / folder)
        k_hat, v_hat = round_trip(pipe)
        expected = {"k": k_hat.contiguous(), "v": v_hat.contiguous()}
        save_file(expected, str(FIXTURE / folder / "expected_decode.safetensors"))
        print(folder, sorted(p.name for p in (FIXTURE / folder).iterdir()))


@pytest.mark.parametrize("folder", sorted(PRESETS))
def test_a_folder_of_format_1_loads_unchanged(folder, tmp_path):
    """It loads, decodes the fixed chunk as it did when saved, and saves again to the same config and parameters."""
    pipe = torchkv.KVPipeline.from_pretrained(FIXTURE / folder)
    pipe.compile = False
    expected = load_file(str(FIXTURE / folder / "expected_decode.safetensors"))
    k_hat, v_hat = round_trip(pipe)
    torch.testing.assert_close(k_hat, expected["k"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_hat, expected["v"], rtol=1e-5, atol=1e-5)
    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / CONFIG_FILE).read_text()) == json.loads((FIXTURE / folder / CONFIG_FILE).read_text())
    if (FIXTURE / folder / PARAMS_FILE).exists():
        saved, again = load_file(str(FIXTURE / folder / PARAMS_FILE)), load_file(str(tmp_path / PARAMS_FILE))
        assert saved.keys() == again.keys() and all(torch.equal(saved[n], again[n]) for n in saved)


def test_a_folder_of_a_later_format_is_refused_with_the_version_it_needs(tmp_path):
    config = json.loads((FIXTURE / "kivi-2bit" / CONFIG_FILE).read_text())
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**config, "version": 2}))
    with pytest.raises(ValueError, match="format version 2 by a later torchkv; this one reads version 1: upgrade"):
        torchkv.KVPipeline.from_pretrained(tmp_path)


if __name__ == "__main__":
    write()
