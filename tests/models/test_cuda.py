"""The CUDA path, on a GPU: compiled (Triton) encoding and decode attention agree with eager PyTorch, and the
cache stays packed on the device. Skipped where no GPU is present (CI); run with `pytest tests/models/test_cuda.py`."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchkv
from torchkv.corpora import documents
from torchkv.models import cache_argument
from torchkv.store import KVStore

pytestmark = [pytest.mark.model, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PRESETS = ["kivi-2bit", "kivi-4bit", "squat-2bit", "subkv-2bit", "svdq-1.25bit-sparse", "xquant-2bit", "xquant-cl-2bit",
           "frontier-2bit", "frontier-2.5bit",
           "frontier-2bit:key_bits=3", "frontier-2bit:key_bits=2.5",  # 6- and 5-bit grid codes in words
           "frontier-2bit:unbiased_values=True"]  # value scales refitted at encode, read by the same kernel


@pytest.fixture(scope="module")
def smollm2_cuda():
    """(model on the GPU, `tokens(n)` -> [1, n] ids): SmolLM2 on Wikipedia text, or where its package is not installed
    (the GPU machine reaches no package index) a model of SmolLM2's layer shape with random weights on random tokens.
    Every test compares two decode paths over the same weights, which need not be trained for that. The random model
    has 8 layers, not 30: the frontier-2bit whole-step test over 30 layers did not finish in 225 s on an H200."""
    try:
        model, tokenizer = torchkv.load_model()
        return model.cuda(), lambda n: documents(tokenizer, n, 1).cuda()
    except RuntimeError as err:
        print(f"SmolLM2 unavailable ({err}); a model of its shape with random weights")
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().cuda()
    generator = torch.Generator().manual_seed(0)
    return model, lambda n: torch.randint(0, config.vocab_size, (1, n), generator=generator).cuda()


def _teacher_forced_logits(model, pipe, prompt, tokens, forbid_history=False, monkeypatch=None):
    """Logits of each decode step after `prompt`, feeding the same `tokens` to every pipeline: [steps, vocab]."""
    with torchkv.patched(model, pipe), torch.no_grad():
        cache = torchkv.new_cache(model)
        model(prompt, **cache_argument(model, cache))
        if forbid_history:
            monkeypatch.setattr(KVStore, "history", lambda self: pytest.fail("history reconstructed in decode"))
        out = [model(tokens[:, i : i + 1], **cache_argument(model, cache)).logits[0, -1]
               for i in range(tokens.shape[1])]
        if forbid_history:
            monkeypatch.undo()
        stored = [t for layer in cache.layers for t in layer.store.tensors().values()]
    assert all(t.device.type == "cuda" for t in stored)
    return torch.stack(out)


@pytest.mark.parametrize("preset", PRESETS)
def test_compiled_cuda_decode_equals_eager(smollm2_cuda, preset, monkeypatch):
    model, tokens_of = smollm2_cuda
    ids = tokens_of(700)
    prompt, tokens = ids[:, :660], ids[:, 660:]
    compiled = torchkv.KVPipeline.from_preset(preset)
    eager = torchkv.KVPipeline.from_preset(preset, compile=False)
    expected = _teacher_forced_logits(model, eager, prompt, tokens)
    got = _teacher_forced_logits(model, compiled, prompt, tokens, forbid_history=compiled.selector is None,
                                 monkeypatch=monkeypatch)
    print(f"{preset}: max |compiled - eager| logit = {(got - expected).abs().max().item():.2e}")
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-3)


@pytest.mark.parametrize("preset", ["kivi-2bit", "kivi-4bit", "squat-2bit", "frontier-2bit"])
def test_whole_step_cuda_graphs_equal_eager(smollm2_cuda, preset):
    """The whole decode step compiled with CUDA graphs (`compile_decode_step`: the host flushes full windows
    between steps) over a fixed-capacity cache gives the per-layer path's logits, across window flushes."""
    model, tokens_of = smollm2_cuda
    ids = tokens_of(760)
    prompt, tokens = ids[:, :660], ids[:, 660:]
    pipe = torchkv.KVPipeline.from_preset(preset)
    expected = _teacher_forced_logits(model, pipe, prompt, tokens)
    step = torchkv.compile_decode_step(model)
    with torchkv.patched(model, pipe), torch.no_grad():
        cache = torchkv.new_cache(model, max_cache_len=768)
        model(prompt, **cache_argument(model, cache))
        got = torch.stack([step(input_ids=tokens[:, i : i + 1], **cache_argument(model, cache)).logits[0, -1].clone()
                           for i in range(tokens.shape[1])])
    assert cache.is_compileable and all(t.device.type == "cuda" for layer in cache.layers
                                        for t in layer.static.tensors().values())
    print(f"{preset}: max |whole step - per layer| logit = {(got - expected).abs().max().item():.2e}")
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-3)
