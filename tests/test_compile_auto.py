"""`compile="auto"`: a function runs eagerly for a number of calls, then compiles once; which steps run compiled
depends on the calls, never on the time they took."""

import pytest
import torch
from torch._dynamo.utils import counters

import torchkv
import torchkv.pipeline
from torchkv.models import cache_argument
from torchkv.testing import tiny_model

PROMPT = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(0))


def _generate(pipe: torchkv.KVPipeline, steps: int = 40) -> tuple[torch.Tensor, int]:
    """Logits of `steps` greedy decode steps after a prompt (two flushes of the window), and the graphs compiled."""
    model = tiny_model("llama", layers=2)
    start = counters["stats"]["unique_graphs"]
    out = []
    with torchkv.patched(model, pipe), torch.no_grad():
        cache = torchkv.new_cache(model)
        logits = model(PROMPT, **cache_argument(model, cache)).logits
        for _ in range(steps):
            logits = model(logits[:, -1:].argmax(-1), **cache_argument(model, cache)).logits
            out.append(logits[0, -1])
    return torch.stack(out), counters["stats"]["unique_graphs"] - start


def _kivi(compile) -> torchkv.KVPipeline:
    return torchkv.KVPipeline.from_preset("kivi-4bit", group=16, residual=16, compile=compile)


def test_auto_is_the_default_and_a_short_generation_under_the_budget_compiles_nothing(monkeypatch):
    monkeypatch.setattr(torchkv.pipeline.codec, "EAGER_CALLS_BEFORE_COMPILE", 2048)
    pipe = torchkv.KVPipeline.from_preset("kivi-4bit", group=16, residual=16)
    assert pipe.compile == "auto" and pipe.fused
    logits, graphs = _generate(pipe)
    assert graphs == 0 and not pipe.codec.compiled
    assert pipe.codec.eager_calls["attend"] == 2 * 40 and pipe.codec.eager_calls["encode"] > 0  # 2 layers, 40 steps
    expected, _ = _generate(_kivi(False))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def test_auto_compiles_each_function_once_its_eager_calls_reach_the_budget(monkeypatch):
    monkeypatch.setattr(torchkv.pipeline.codec, "EAGER_CALLS_BEFORE_COMPILE", 1)  # the second call compiles
    pipe = _kivi("auto")
    logits, graphs = _generate(pipe)
    assert set(pipe.codec.compiled) == {"attend", "encode"} and graphs > 0
    assert pipe.codec.eager_calls == {"attend": 1, "encode": 1}
    _, more = _generate(pipe)
    assert more == 0 and pipe.codec.eager_calls == {"attend": 1, "encode": 1}, \
        "compiled functions went back to eager or recompiled"
    expected, _ = _generate(_kivi(True))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def test_compile_rejects_anything_but_true_false_or_auto():
    with pytest.raises(ValueError, match="'auto'"):
        torchkv.KVPipeline.from_preset("kivi-4bit", compile="always")
