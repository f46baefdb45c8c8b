"""Long-generation soak on a tiny model (issue 22), with the checks of `benchmarks/soak.py`: memory grows only with
the cache, the count of compiled graphs is bounded (no graph over the last quarter of the tokens), and the first 256
tokens agree with an eager run."""

from pathlib import Path

import pytest

from torchkv.testing import load_script, tiny_model

soak_module = load_script(Path(__file__).parents[1] / "benchmarks" / "soak.py")


def _run(preset: str, tokens: int, check: int = 256) -> dict:
    import torch

    model = tiny_model(layers=2, max_position_embeddings=9000)
    prompt = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    return soak_module.soak(model, prompt, preset, tokens, warmup=check, check=check, every=32,
                            residual=32)


def _check(report: dict, tokens: int, check: int = 256) -> None:
    assert report["generated"] == tokens
    # memory: RSS after warm-up grows by no more than the cache does (+64 MiB slack), and the cache no faster
    # than its own bytes per token
    assert report["memory_ok"], {k: report[k] for k in ("rss_growth_after_warmup", "cache_growth_after_warmup",
                                                        "cache_bytes_per_token")}
    sizes = [s["cache_bytes"] for s in report["samples"]]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
    assert report["graphs_compiled"] > 0 and report["graphs_ok"], report["samples"]
    assert report["agreeing_tokens"] == report["checked_tokens"] == check


@pytest.mark.parametrize("preset", ["kivi-2bit", "frontier-2bit"])
def test_a_short_soak(preset):
    """`make test`'s variant: 320 tokens, warm-up and agreement over the first 128 (the full one is slow)."""
    _check(_run(preset, 320, check=128), 320, check=128)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["kivi-2bit", "frontier-2bit"])
def test_an_8000_token_soak(preset):
    _check(_run(preset, 8000), 8000)
