"""Compiled decode attention over packed codes: bounded compilation, no reconstructed history, same outputs."""

import pytest
import torch
from torch._dynamo.utils import counters

import torchkv
import torchkv.transforms as T
from torchkv.eval.data import documents
from torchkv.store import KVStore
from torchkv.testing import tiny_model


@pytest.mark.parametrize(
    "preset,layers,options",
    [("kivi-4bit", 2, {"group": 16}),  # fused decode attention over packed codes
     ("xquant-cl-2bit", 4, {"group": 16, "token_group": 32, "first_layers": 2})],  # rematerialized, cross-layer
    ids=["kivi-4bit", "xquant-cl-2bit"],
)
def test_graph_count_does_not_grow_with_generation_length(preset, layers, options):
    model = tiny_model("llama", layers=layers)
    pipe = torchkv.KVPipeline.from_preset(preset, residual=16, **options)
    prompt = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(0))
    with torchkv.patched(model, pipe), torch.no_grad():
        cache = torchkv.new_cache(model)
        logits = model(prompt, past_key_values=cache).logits
        graphs = []
        for step in range(1000):
            token = logits[:, -1:].argmax(-1)
            logits = model(token, past_key_values=cache).logits
            if step in (150, 999):
                graphs.append(counters["stats"]["unique_graphs"])
    assert cache.layers[0].store.n_encoded > 960
    assert graphs[1] == graphs[0], f"{graphs[1] - graphs[0]} graphs compiled between tokens 150 and 1000"


@pytest.mark.model
@pytest.mark.parametrize(
    "pipe",
    [
        torchkv.KVPipeline.from_preset("kivi-2bit"),
        torchkv.KVPipeline.from_preset("kivi-4bit", sinks=4),
        torchkv.KVPipeline(
            [T.rotate("hadamard"), T.quantize(bits=4, axis="token", group=32, symmetric=True), T.pack()],
            [T.rotate("hadamard"), T.quantize(bits=2, axis="channel", group=32), T.pack()],
            residual=64,
        ),
    ],
    ids=["kivi-2bit", "kivi-4bit-sinks", "hadamard-mixed"],
)
def test_fused_decode_matches_reconstruction_and_never_rebuilds_the_history(smollm2, pipe, monkeypatch):
    model, tokenizer = smollm2
    assert pipe.fused
    prompt = documents(tokenizer, 700, 1)
    # the same recipe run eagerly, reconstructing the history at every step
    reference_pipe = torchkv.KVPipeline(pipe.keys.transforms, pipe.values.transforms, residual=pipe.residual,
                                        sinks=pipe.sinks, compile=False)
    assert not reference_pipe.fused
    steps = []
    for p in (reference_pipe, pipe):
        with torchkv.patched(model, p), torch.no_grad():
            cache = torchkv.new_cache(model)
            logits = model(prompt, past_key_values=cache).logits[:, -1:]
            if p is pipe:  # from here on, decoding must read the packed codes only
                monkeypatch.setattr(KVStore, "history", lambda self: pytest.fail("history reconstructed in decode"))
            out = []
            for _ in range(40):
                token = logits.argmax(-1)
                logits = model(token, past_key_values=cache).logits
                out.append(logits[0, -1])
            steps.append(torch.stack(out))
            monkeypatch.undo()
    torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=2e-3)
