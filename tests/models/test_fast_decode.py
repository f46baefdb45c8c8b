"""Compiled decode attention over the stored form: bounded compilation, no reconstructed history, same outputs."""

import pytest
import torch
from torch._dynamo.utils import counters

import torchkv
import torchkv.transforms as T
from torchkv.corpora import documents
from torchkv.models import cache_argument
from torchkv.pipeline import HeadGroups
from torchkv.store import KVStore
from torchkv.testing import tiny_model
from torchkv.window import PromptOnly


@pytest.mark.parametrize(
    "preset,layers,options",
    [("kivi-4bit", 2, {"group": 16}),  # fused decode attention over packed codes
     ("xquant-cl-2bit", 4, {"group": 16, "token_group": 32, "first_layers": 2}),  # rematerialized, cross-layer
     ("svdq-1.25bit", 2, {"group": 16, "residual": 0}),  # prompt-only window: full precision grows
     ("frontier-2.5bit", 3, {"wide_layers": 1})],  # look-up-table scores, sinks, a wider first layer
    ids=["kivi-4bit", "xquant-cl-2bit", "svdq-1.25bit", "frontier-2.5bit"],
)
def test_graph_count_does_not_grow_with_generation_length(preset, layers, options):
    model = tiny_model("llama", layers=layers)
    pipe = torchkv.KVPipeline.from_preset(preset, **{"residual": 16, **options})
    prompt = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(0))
    with torchkv.patched(model, pipe), torch.no_grad():
        cache = torchkv.new_cache(model)
        logits = model(prompt, **cache_argument(model, cache)).logits
        graphs = []
        for step in range(600):
            token = logits[:, -1:].argmax(-1)
            logits = model(token, **cache_argument(model, cache)).logits
            if step in (150, 599):
                graphs.append(counters["stats"]["unique_graphs"])
    store = cache.layers[0].store
    assert store.n_encoded > 560 or store.n_residual > 560  # encoded chunks, or the full-precision part, grew
    assert graphs[1] == graphs[0], f"{graphs[1] - graphs[0]} graphs compiled between tokens 150 and 600"


def _cast_chains(compile: bool) -> torchkv.KVPipeline:
    """The whole cache in float16 with a full-precision window (fp16 without its window, where every new token
    is rounded at once, diverges chaotically between any two summation orders)."""
    return torchkv.KVPipeline([T.quantize("cast", dtype="float16")], [T.quantize("cast", dtype="float16")],
                              residual=64, compile=compile)


def _hadamard_mixed(compile: bool) -> torchkv.KVPipeline:
    return torchkv.KVPipeline(
        [T.rotate("hadamard"), T.quantize(bits=4, axis="token", group=32, symmetric=True), T.pack()],
        [T.rotate("hadamard"), T.quantize(bits=2, axis="channel", group=32), T.pack()],
        residual=64, compile=compile,
    )


def _per_head_widths(compile: bool) -> torchkv.KVPipeline:
    """SmolLM2's 3 KV heads in groups of their own widths (`torchkv tune --per-head`): 2.5- and 3.5-bit keys (5- and
    7-bit codes of 2-D grids, in words) on heads 0 and 2, 4-bit values on head 0, frontier-2bit's chains on the
    others, head 1's keys centred by a turned centre (the 2.1-bit recipe's mix)."""
    base = torchkv.KVPipeline.from_preset("frontier-2bit")
    centred = torchkv.KVPipeline.from_preset("frontier-2bit", rotary_center=True)
    wide = torchkv.KVPipeline.from_preset("frontier-2bit", key_bits=2.5, bits=4)
    wider = torchkv.KVPipeline.from_preset("frontier-2bit", key_bits=3.5)
    return torchkv.KVPipeline(HeadGroups([([1], centred.keys), ([0], wide.keys), ([2], wider.keys)]),
                              HeadGroups([([0], wide.values), ([1, 2], base.values)]),
                              residual=base.residual, sinks=base.sinks, chunk=base.chunk, compile=compile)


def _preset(name: str, **options):
    return lambda compile: torchkv.KVPipeline.from_preset(name, compile=compile, **options)


#: (pipeline factory, fused): fused ones read both chains' stored forms; the others rebuild keys (pre-RoPE,
#: rematerialized from X, predicted) inside the same compiled graph, and XQuant sums its values in the latent
COMPILED_DECODE = {
    "kivi-2bit": (_preset("kivi-2bit"), True),
    "kivi-4bit-sinks": (_preset("kivi-4bit", sinks=4), True),
    # Hadamard-rotated chains run fused in "frontier-2.5bit-3bit-keys-query-metric" and "per-head-widths" (values)
    "hadamard-mixed": pytest.param((_hadamard_mixed, True), marks=pytest.mark.slow),
    "float16-window": (_cast_chains, True),
    # its chains run compiled inside "per-head-widths" (heads 1, 1-2), which keeps the suite within its time
    "frontier-2bit": pytest.param((_preset("frontier-2bit"), True), marks=pytest.mark.slow),
    # wider first layers (8-bit codes of 4-bit keys), 6-bit codes of 3-bit keys packed in words after them, each
    # chosen under the prompt queries' metric (chunks flushed in the compiled step encode with it)
    "frontier-2.5bit-3bit-keys-query-metric": (_preset("frontier-2.5bit", key_bits=3, query_metric=True), True),
    "per-head-widths": (_per_head_widths, True),
    # keys centred by a per-token turned offset, added to the codes' scores from the chunks' cos/sin: head 1 of
    # "per-head-widths" runs this chain compiled, by chunk, under the same assertions
    "frontier-2bit-rotary-center": pytest.param((_preset("frontier-2bit", rotary_center=True), True),
                                                marks=pytest.mark.slow),
    # "xquant-cl-2bit" rematerializes keys and sums values in the latent the same way, across layers too
    "xquant-2bit": pytest.param((_preset("xquant-2bit"), False), marks=pytest.mark.slow),
    "xquant-cl-2bit": (_preset("xquant-cl-2bit"), False),
    "svdq-1.25bit-v4": (_preset("svdq-1.25bit-v4"), False),
    "svdq-1.25bit": pytest.param((_preset("svdq-1.25bit"), False), marks=pytest.mark.slow),
    "aquakv-2bit-nopred": pytest.param((_preset("aquakv-2bit-nopred"), False), marks=pytest.mark.slow),
    "squat-pre-2bit": pytest.param((_preset("squat-pre-2bit"), False), marks=pytest.mark.slow),
}


@pytest.mark.model
@pytest.mark.parametrize("case", COMPILED_DECODE.values(), ids=COMPILED_DECODE.keys())
def test_compiled_decode_matches_eager_and_never_rebuilds_the_history(smollm2, case, monkeypatch):
    """Teacher-forced decode steps after a 764-token prompt: the compiled step (one graph per layer over the stored
    form) gives the eager pipeline's logits, and never calls `KVStore.history` (reconstruct, then concatenate). The
    prompt leaves every window within 8 tokens of its flush, so the steps also encode a chunk (except where only the
    prompt is encoded)."""
    factory, fused = case
    model, tokenizer = smollm2
    ids = documents(tokenizer, 776, 1)
    prompt, tokens = ids[:, :764], ids[:, 764:]
    pipe, reference_pipe = factory(True), factory(False)
    assert pipe.fused == fused and not reference_pipe.fused
    steps = []
    for p in (reference_pipe, pipe):
        with torchkv.patched(model, p), torch.no_grad():
            cache = torchkv.new_cache(model)
            model(prompt, **cache_argument(model, cache))
            encoded = cache.layers[0].store.n_encoded
            if p is pipe:
                monkeypatch.setattr(KVStore, "history", lambda self: pytest.fail("history reconstructed in decode"))
            steps.append(torch.stack([model(tokens[:, i : i + 1], **cache_argument(model, cache)).logits[0, -1]
                                      for i in range(tokens.shape[1])]))
            monkeypatch.undo()
            stores = [layer.store for layer in cache.layers]
            if stores[0].positions is not None:  # the layers hold one ids tensor; no step's cos/sin outlives it
                assert all(s.positions.ids is stores[0].positions.ids for s in stores)
                assert stores[0].positions.shared.tables_held == 0
                if stores[0].pipeline.codec.attention_rope == "chunks":  # a turned centre's offsets: by chunk
                    assert all(s.positions.by_chunk for s in stores)
                    inputs = stores[0].attention_inputs()
                    assert "anchor_cos" in inputs and "cos" not in inputs
            flushed = cache.layers[0].store.n_encoded > encoded
            assert flushed != isinstance(p.window, PromptOnly), f"flushed: {flushed}, window: {p.window}"
    torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=2e-3)
