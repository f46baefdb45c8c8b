"""`benchmarks/balance_prior.py`: a prompt's balance scales pooled with prior tokens read them as more prompt tokens."""

from pathlib import Path

import torch

import torchkv
from torchkv.testing import load_script

balance_prior = load_script(Path(__file__).parents[1] / "benchmarks" / "balance_prior.py")


def _tokens(gen: torch.Generator, t: int, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Queries `[1, 4, t, 16]`, keys and values `[1, 2, t, 16]`, the keys' channels scaled by `scale`."""
    return (torch.randn(1, 4, t, 16, generator=gen), torch.randn(1, 2, t, 16, generator=gen) * scale,
            torch.randn(1, 2, t, 16, generator=gen))


def _balance(prepare, pipe, q, k, v) -> torch.Tensor:
    valid = torch.ones(1, k.shape[2], dtype=torch.bool)
    return prepare(pipe, k, v, layer=0, valid=valid, inputs={"queries": q})["k.0.balance"]


def test_pooled_balance_reads_prior_tokens_as_more_prompt_tokens():
    pipe = torchkv.KVPipeline.from_preset("frontier-2bit", compile=False)
    gen = torch.Generator().manual_seed(0)
    q, k, v = _tokens(gen, 24, torch.linspace(0.5, 4.0, 16))
    prompt_only = _balance(torchkv.KVPipeline.prepare, pipe, q, k, v)
    # the prompt's own statistics pooled again leave its scales as they are
    same = balance_prior.pooled_prepare([(q, k, v)])
    torch.testing.assert_close(_balance(same, pipe, q, k, v), prompt_only)
    # a long prior with other channel energies pulls the scales to its own
    prior = _tokens(gen, 2400, torch.linspace(4.0, 0.5, 16))
    pooled = _balance(balance_prior.pooled_prepare([prior]), pipe, q, k, v)
    prior_only = _balance(torchkv.KVPipeline.prepare, pipe, *prior)
    assert (pooled - prior_only).abs().max() < 0.2 * (prompt_only - prior_only).abs().max()
    # as long as the prompt, it moves them about half way (in log scale), not all the way
    short = _tokens(gen, 24, torch.linspace(4.0, 0.5, 16))
    shift = (_balance(balance_prior.pooled_prepare([short]), pipe, q, k, v).log() - prompt_only.log()).abs().max()
    full = (_balance(torchkv.KVPipeline.prepare, pipe, *short).log() - prompt_only.log()).abs().max()
    assert 0.25 * full < shift < 0.75 * full
