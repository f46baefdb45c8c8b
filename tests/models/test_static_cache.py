"""Fixed-capacity caches (`max_cache_len`): decode steps on static buffers, and the whole step compiled."""

import gc
import inspect
import weakref

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from transformers import CompileConfig, StaticCache

import torchkv
import torchkv.transforms as T
from torchkv.models import cache_argument
from torchkv.static_store import StaticKVStore
from torchkv.testing import TINY_ARCHITECTURES, tiny_model

ARCHS = sorted(TINY_ARCHITECTURES)


def lossless(sinks: int = 0) -> torchkv.KVPipeline:
    """Exact storage (float32), eager: generation must equal the model's own token for token."""
    cast = [T.quantize("cast", dtype="float32")]
    return torchkv.KVPipeline(cast, cast, residual=8, chunk=8, sinks=sinks, compile=False)


def _prompt(batch=2, length=80, pad=11, seed=0):
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return ids, mask


def _generate(model, ids, mask, n=40, **options):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True, **options)


@pytest.mark.parametrize("arch", ARCHS)
def test_static_buffers_generate_like_the_model(arch):
    """cache_implementation="static" on a patched model decodes on fixed buffers (sinks, chunk flushes, left
    padding, sliding-window layers, soft-capping) and still generates exactly what the model does."""
    model = tiny_model(arch)
    ids, mask = _prompt()
    expected = _generate(model, ids, mask).sequences
    with torchkv.patched(model, lossless(sinks=3)):
        if all(torchkv.models.arch.sliding_windows(model)):  # a StaticCache of such a model keeps no length
            with pytest.raises(ValueError, match="sliding window"):
                _generate(model, ids, mask, cache_implementation="static")
            out = _generate(model, ids, mask, cache=torchkv.new_cache(model, max_cache_len=120))
        else:
            out = _generate(model, ids, mask, cache_implementation="static")
    cache = out.past_key_values
    # each row group (the rows' pads differ) on fixed-capacity buffers of its own
    assert cache.is_compileable and all(len(layer.frozen_stores()) == 2 for layer in cache.layers)
    windows = torchkv.models.arch.sliding_windows(model)
    for layer, window in zip(cache.layers, windows):
        stores = layer.frozen_stores()
        if window is None:
            assert int(stores[1].buffers["n_chunks"]) * 8 > 80  # chunks encoded during decode
        else:  # the chunk slots its window reaches, the oldest dropped as new ones came
            assert all(store.chunks == -(-(window - 1) // 8) + 1 for store in stores)
            assert int(stores[1].buffers["dropped"]) > 0
    assert torch.equal(out.sequences, expected)


def _decode(model, cache, ids, steps, forward=None, start=0):
    """Greedy steps after a prompt at positions from `start`; returns the logits of every step `[steps, B, V]`."""
    forward = forward or model
    passed = cache_argument(model, cache)
    prompt_positions = torch.arange(start, start + ids.shape[1])[None]
    logits, out = model(input_ids=ids, position_ids=prompt_positions, **passed, use_cache=True).logits, []
    position = start + ids.shape[1]
    for _ in range(steps):
        token = logits[:, -1:].argmax(-1)
        logits = forward(input_ids=token, position_ids=torch.tensor([[position]]), **passed, use_cache=True).logits
        out.append(logits[:, -1])
        position += 1
    return torch.stack(out)


@torch.no_grad()
# squat-2bit (make test-slow) stores kivi-2bit's layout, with per-sequence state as frontier-2bit's balance scales are
@pytest.mark.parametrize("preset", ["kivi-2bit", "frontier-2bit", "frontier-2bit:rotary_center=True",
                                    pytest.param("squat-2bit", marks=pytest.mark.slow)])
def test_static_decode_matches_growing_store_on_smollm2(smollm2, preset):
    """The same tokens in the same encoded form: the logits of fixed-buffer decode steps equal the growing store's."""
    model, tokenizer = smollm2
    ids = tokenizer("The history of the city of Paris begins " * 12, return_tensors="pt").input_ids[:, :100]
    pipe = torchkv.KVPipeline.from_preset(preset, residual=32)
    with torchkv.patched(model, pipe):
        growing = _decode(model, torchkv.new_cache(model), ids, 40)
        static = _decode(model, torchkv.new_cache(model, max_cache_len=160), ids, 40)
    assert (static - growing).abs().max() < 1e-3


@torch.no_grad()
@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("gemma3_text", {}),
                                             ("phi3", {"partial_rotary_factor": 0.5})])
def test_a_turned_key_centre_decodes_on_fixed_buffers_as_on_growing_stores(arch, overrides):
    """frontier-2bit with `rotary_center` (8-token chunks) on fixed-capacity buffers: a left-padded batch in row groups
    (rows whose pads differ by whole chunks share one, so a row's position ids are not its token indices), chunks
    encoded during decode at the model's position ids (sliding-window layers, partial rotary), generates what the
    growing stores generate, with their scores."""
    model = tiny_model(arch, **overrides)
    ids, mask = _prompt(batch=3)
    mask[2, :40] = 0
    pipe = torchkv.KVPipeline.from_preset("frontier-2bit", rotary_center=True, residual=8, chunk=8, sinks=0,
                                          compile=False)
    with torchkv.patched(model, pipe):
        growing = _generate(model, ids, mask, output_scores=True)
        static = _generate(model, ids, mask, output_scores=True, cache=torchkv.new_cache(model, max_cache_len=130))
    stores = static.past_key_values.layers[0].frozen_stores()
    buffers = stores[1].buffers  # chunks encoded during decode (a sliding layer dropped the oldest)
    assert len(stores) == 2 and int(buffers["n_chunks"]) * 8 + int(buffers["dropped"]) > 80
    assert torch.equal(static.sequences, growing.sequences)
    torch.testing.assert_close(torch.stack(static.scores), torch.stack(growing.scores), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_a_turned_key_centre_thaws_for_a_multi_token_step_and_freezes_again():
    """Decode steps, then a 6-token step (the buffers' tokens and positions back in a growing store), then more
    decode steps, with sinks and position ids that start at 100: the logits of the growing store's."""
    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0, length=45)
    more = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    pipe = torchkv.KVPipeline.from_preset("frontier-2bit", rotary_center=True, residual=8, chunk=8, sinks=2,
                                          compile=False)
    logits, encoded = [], []
    with torchkv.patched(model, pipe):
        for capacity in (None, 120):
            cache = torchkv.new_cache(model, max_cache_len=capacity)
            first = _decode(model, cache, ids, 20, start=100)
            passed = cache_argument(model, cache)
            out = [model(input_ids=more, position_ids=torch.arange(165, 171)[None], **passed, use_cache=True).logits[0]]
            for position in range(171, 191):
                token = out[-1][-1:].argmax(-1)[None]
                out.append(model(input_ids=token, position_ids=torch.tensor([[position]]), **passed,
                                 use_cache=True).logits[0])
            logits.append(torch.cat([first.flatten(0, 1), *out]))
            encoded.append(cache.layers[0].held.n_encoded)
    assert cache.layers[0].frozen and encoded[1] == encoded[0] > 71
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_whole_step_traces_into_one_graph_for_1000_tokens():
    """fullgraph=True over model and cache, one graph for 1,000 steps across window flushes and chunk encodes,
    and the compiled steps equal the eager ones. On the CPU each layer encodes its window under a `torch.cond`,
    so a step whose window is not full encodes nothing."""
    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0)
    pipe = torchkv.KVPipeline.from_preset("kivi-2bit", residual=32)
    counter = CompileCounterWithBackend("eager")
    with torchkv.patched(model, pipe):
        step = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=counter)  # the patch's forward
        eager = _decode(model, torchkv.new_cache(model, max_cache_len=1100), ids, 1000)
        compiled = _decode(model, torchkv.new_cache(model, max_cache_len=1100), ids, 1000, forward=step)
    assert counter.frame_count == 1
    conds = [n for n in counter.graphs[0].graph.nodes if n.target is torch.ops.higher_order.cond]
    assert len(conds) == model.config.num_hidden_layers
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)  # float sums in another order


@torch.no_grad()
def test_an_eager_forward_after_a_compiled_step_returns_its_hidden_states():
    """transformers collects `output_hidden_states` through a variable it sets before the layers and resets after;
    a compiled step whose layers flush under a `torch.cond` left it set (torch 2.13, see
    `torchkv._compat._follow_live_side_effects`), and the next eager forward returned no hidden state."""
    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0)
    with torchkv.patched(model, torchkv.KVPipeline.from_preset("kivi-2bit", residual=32)):
        step = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="eager")
        _decode(model, torchkv.new_cache(model, max_cache_len=200), ids, 1, forward=step)
        out = model(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1


@torch.no_grad()
@pytest.mark.parametrize("preset", ["kivi-4bit", "frontier-2bit", "frontier-2bit:rotary_center=True"])
def test_inductor_whole_step_equals_eager(preset):  # kivi-4bit's graph is the one the benchmark row test below reuses
    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0)
    pipe = torchkv.KVPipeline.from_preset(preset, residual=32)
    with torchkv.patched(model, pipe):
        step = torch.compile(model.forward, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True})
        eager = _decode(model, torchkv.new_cache(model, max_cache_len=200), ids, 48)
        compiled = _decode(model, torchkv.new_cache(model, max_cache_len=200), ids, 48, forward=step)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_a_one_token_prompt_steps_eagerly_on_growing_stores_until_they_prepare():
    """frontier-2bit prepares its balance scales once a chunk of tokens is held: after a one-token prompt the whole
    step compiled (`compile_decode_step`) runs eagerly on growing stores until then, and on the fixed buffers after,
    with the eager growing store's logits."""
    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0, length=1)
    pipe = torchkv.KVPipeline.from_preset("frontier-2bit", residual=32)
    with torchkv.patched(model, pipe):
        cache = torchkv.new_cache(model, max_cache_len=200)
        step = torchkv.compile_decode_step(model)
        waited = []
        forward = lambda **kw: (waited.append(cache.awaits_prepare), step(**kw))[1]  # noqa: E731
        compiled = _decode(model, cache, ids, 100, forward=forward)
        eager = _decode(model, torchkv.new_cache(model), ids, 100)
    assert waited == [True] * (pipe.chunk - 1) + [False] * (101 - pipe.chunk)
    assert all(layer.frozen for layer in cache.layers) and int(cache.layers[0].static.buffers["n_chunks"]) == 2
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_inductor_shifts_a_window_longer_than_two_chunks_as_eager_does():
    """A window of 160 tokens whose flush shifts 128 of them by one chunk of 32 (kivi-2bit's defaults): the kept and
    the overwritten slots overlap, which Inductor's in-place shift once got wrong at SmolLM2's head sizes (logits
    0.35 off eager after the first flush)."""
    model = tiny_model("llama", heads=9, kv_heads=3, layers=1, hidden_size=576, intermediate_size=256, head_dim=64)
    ids, _ = _prompt(batch=1, pad=0, length=70)
    with torchkv.patched(model, "kivi-2bit"):
        step = torch.compile(model.forward, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True})
        eager = _decode(model, torchkv.new_cache(model, max_cache_len=200), ids, 100)
        compiled = _decode(model, torchkv.new_cache(model, max_cache_len=200), ids, 100, forward=step)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_inductor_drops_a_sliding_layers_oldest_chunk_as_eager_does():
    """gemma3_text's sliding layers (window 48) keep 7 chunk slots of 8 tokens: over 60 steps after an 80-token
    prompt, the compiled whole step drops the oldest chunk at each flush that finds them full, as eager does."""
    model = tiny_model("gemma3_text")
    ids, _ = _prompt(batch=1, pad=0)
    with torchkv.patched(model, torchkv.KVPipeline.from_preset("kivi-2bit", residual=8, group=8)):
        step = torch.compile(model.forward, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True})
        caches = [torchkv.new_cache(model, max_cache_len=160) for _ in range(2)]
        eager = _decode(model, caches[0], ids, 60)
        compiled = _decode(model, caches[1], ids, 60, forward=step)
    sliding = caches[1].layers[0].static
    assert sliding.chunks == 7 and int(sliding.buffers["dropped"]) == int(caches[0].layers[0].static.buffers["dropped"])
    assert int(sliding.buffers["dropped"]) >= 40
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_compiled_step_flushes_from_the_host_only_when_the_window_fills(monkeypatch):
    """`compile_decode_step`: the step graph encodes nothing; the host encodes each layer's oldest chunk on exactly
    the steps that fill its window (sinks first), and the logits equal eager steps across those flushes."""
    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0, length=45)
    pipe = torchkv.KVPipeline.from_preset("kivi-4bit", residual=16, sinks=2)  # window 16 + 32 tokens
    encodes = []
    encode = StaticKVStore._encode_window
    monkeypatch.setattr(StaticKVStore, "_encode_window", lambda self, *a: encodes.append(self) or encode(self, *a))
    with torchkv.patched(model, pipe):
        eager = _decode(model, torchkv.new_cache(model, max_cache_len=200), ids, 80)
        eager_encodes, encodes[:] = len(encodes), []
        step = torchkv.compile_decode_step(model)
        compiled = _decode(model, torchkv.new_cache(model, max_cache_len=200), ids, 80, forward=step)
    # 45 prompt tokens: 2 sinks and 43 in the window, which holds 48 after 5 steps and again every 32 steps:
    # flushes after steps 5, 37 and 69 in each layer (a step graph that encoded would also have traced an encode)
    assert eager_encodes == len(encodes) == 3 * model.config.num_hidden_layers
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)

    def mixed(**inputs):  # every third step eager: steps the host does not count, after which it reads the counts
        mixed.steps += 1
        return (model if mixed.steps % 3 == 0 else step)(**inputs)

    mixed.steps = 0
    with torchkv.patched(model, pipe):
        got = _decode(model, torchkv.new_cache(model, max_cache_len=200), ids, 80, forward=mixed)
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)

    # the step's guards leave out the model's modules, not the cache's tensors: the same callable over a batch of two
    # compiles a graph of its own and gives eager's logits
    ids, _ = _prompt(batch=2, pad=0, length=45)
    with torchkv.patched(model, pipe):
        eager = _decode(model, torchkv.new_cache(model, max_cache_len=200), ids, 40)
        compiled = _decode(model, torchkv.new_cache(model, max_cache_len=200), ids, 40, forward=step)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def _decode_padded(model, ids, mask, steps, forward, capacity):
    """`_decode` for a left-padded batch (positions counted from each row's first real token); returns the logits
    of every step and the cache."""
    cache = torchkv.new_cache(model, max_cache_len=capacity)
    passed = cache_argument(model, cache)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **passed,
                   use_cache=True).logits
    out = []
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits = forward(input_ids=logits[:, -1:].argmax(-1), attention_mask=mask,
                         position_ids=mask.sum(-1, keepdim=True) - 1, **passed, use_cache=True).logits
        out.append(logits[:, -1])
    return torch.stack(out), cache


@torch.no_grad()
def test_the_host_flushes_each_row_group_as_its_step_would(monkeypatch):
    """`compile_decode_step` over a padded batch: each row group's buffers are counted and flushed by the host (the
    graph itself is run eagerly here), and the logits equal steps that flush inside themselves."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    encodes, host_counts = [], []
    encode, count = StaticKVStore._encode_window, StaticKVStore.flush_if_full
    monkeypatch.setattr(StaticKVStore, "_encode_window", lambda self, *a: encodes.append(self) or encode(self, *a))
    monkeypatch.setattr(StaticKVStore, "flush_if_full", lambda self: host_counts.append(self) or count(self))
    model = tiny_model("llama")
    ids, mask = _prompt(batch=2, length=60, pad=13)
    pipe = torchkv.KVPipeline.from_preset("kivi-2bit", residual=8, group=8, sinks=2, compile=False)
    with torchkv.patched(model, pipe):
        in_step, cache = _decode_padded(model, ids, mask, 30, model, 100)
        in_step_encodes, encodes[:] = list(encodes), []
        by_host, host_cache = _decode_padded(model, ids, mask, 30, torchkv.compile_decode_step(model), 100)
    groups = cache.layers[0].frozen_stores()
    assert len(groups) == 2 and all(group in in_step_encodes for group in groups)
    assert all(host_counts.count(group) == 30 for group in host_cache.layers[0].frozen_stores())
    assert len(encodes) == len(in_step_encodes) > 0
    torch.testing.assert_close(by_host, in_step, atol=0, rtol=0)


@pytest.mark.eager_first  # the step's graph is the subject: prompts and eager steps run as users get them
@torch.no_grad()
def test_compiled_step_over_a_padded_batch_compiles_one_graph():
    """`compile_decode_step` over a left-padded batch whose 2-D mask grows by a column per step: the step pads it to
    the cache's capacity, so 12 steps (past Dynamo's recompile limit of 8, where it stopped with an error) and a
    flush of each row group run one graph, with eager's logits."""
    model = tiny_model("llama")
    ids, mask = _prompt(batch=2, length=60, pad=13)
    pipe = torchkv.KVPipeline.from_preset("kivi-2bit", residual=8, group=8, sinks=2)
    with torchkv.patched(model, pipe):
        eager, _ = _decode_padded(model, ids, mask, 12, model, 100)
        graphs = counters["stats"]["unique_graphs"]
        compiled, _ = _decode_padded(model, ids, mask, 12, torchkv.compile_decode_step(model), 100)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_generate_compiles_the_step_with_a_compile_config():
    model = tiny_model("llama")
    ids, mask = _prompt(batch=1, pad=0)
    config = CompileConfig(fullgraph=True, backend="eager", dynamic=False)
    config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    with torchkv.patched(model, "kivi-4bit"):
        eager = _generate(model, ids, mask, cache_implementation="static").sequences
        compiled = _generate(model, ids, mask, cache_implementation="static", compile_config=config).sequences
    assert hasattr(model, "_compiled_call")  # generate took the compiled path
    assert torch.equal(compiled, eager)


def test_generate_from_a_one_token_prompt_with_a_compile_config_waits_for_the_prepared_state():
    """`generate`'s compiled call runs eagerly until frontier-2bit's stores hold a chunk and prepare, then compiled on
    the fixed buffers (chunks encoded there), and generates what eager generation does."""
    model = tiny_model("llama")
    ids, mask = _prompt(batch=1, pad=0, length=1)
    config = CompileConfig(fullgraph=True, backend="eager", dynamic=False)
    config._compile_all_devices = True
    with torchkv.patched(model, torchkv.KVPipeline.from_preset("frontier-2bit", residual=32)):
        eager = _generate(model, ids, mask, n=100, cache_implementation="static").sequences
        out = _generate(model, ids, mask, n=100, cache_implementation="static", compile_config=config)
    assert hasattr(model, "_compiled_call") and int(out.past_key_values.layers[0].static.buffers["n_chunks"]) == 2
    assert torch.equal(out.sequences, eager)


def test_each_patch_compiles_the_forward_on_a_code_object_of_its_own():
    """`generate`'s compiled step enters dynamo at the model's forward, whose code object every model of a class
    shares. A patched model gets a copy of its own, so graphs compiled under other patches (other presets, other
    models) do not count against its recompile limit; `unpatch` gives back the class's forward."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0)
    codes = []
    for preset in ("kivi-4bit", "kivi-2bit"):
        with torchkv.patched(model, preset):
            model.get_compiled_call(CompileConfig(fullgraph=True, backend="eager"))(input_ids=ids, use_cache=True)
            codes.append(model.forward.__func__.__code__)
            assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    assert codes[0] is not codes[1] and type(model).forward.__code__ not in codes
    assert [len(_debug_get_cache_entry_list(code)) for code in codes] == [1, 1]
    assert "forward" not in vars(model)
    alive = weakref.ref(torchkv.patch(model, "kivi-2bit"))
    del model
    gc.collect()
    assert alive() is None  # the registry of patches holds no reference to a patched model


def test_generate_compiles_the_step_with_the_whole_step_options(monkeypatch):
    """A patched model's `get_compiled_call` (what `generate` compiles with) adds `emulate_precision_casts`, so that
    compiled steps round through the stored dtypes as eager ones do (by hand, tiny Llama in float32: compiled and
    eager log-probabilities 2.8e-3 apart without it, 1e-6 with it); a mode becomes its options, and other backends
    and unpatched models are left alone."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(kwargs) or fn)
    model = tiny_model("llama")
    with torchkv.patched(model, "kivi-2bit"):
        model.get_compiled_call(CompileConfig(fullgraph=True))
        model.get_compiled_call(CompileConfig(fullgraph=True))  # the same config: compiled once
        model.get_compiled_call(CompileConfig(fullgraph=True, backend="eager"))
    model.get_compiled_call(CompileConfig(fullgraph=True, options={"max_autotune": True}))
    assert compiled[0]["mode"] is None and compiled[0]["options"] == {
        "triton.cudagraphs": True, "emulate_precision_casts": True}  # mode="reduce-overhead", the default
    assert len(compiled) == 3 and compiled[1]["options"] is None and compiled[1]["mode"] == "reduce-overhead"
    assert compiled[2]["options"] == {"max_autotune": True}


def test_static_storage_is_compressed():
    """Fixed capacity is allocated up front, and compressed: kivi-2bit's buffers for 4,096 tokens take under a
    third of transformers' StaticCache for the same tokens (fp32)."""
    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0)
    with torchkv.patched(model, "kivi-2bit"):
        cache = torchkv.new_cache(model, max_cache_len=4096)
        model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
    static = StaticCache(config=model.config, max_cache_len=4096)
    model(input_ids=ids, **cache_argument(model, static), use_cache=True)
    full = sum(layer.keys.nbytes + layer.values.nbytes for layer in static.layers)
    assert cache.nbytes() == sum(t.untyped_storage().nbytes() for layer in cache.layers
                                 for t in layer.static.tensors().values())
    assert cache.nbytes() < full / 3


def test_capacity_overflow_is_a_clear_error():
    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0)
    with torchkv.patched(model, "kivi-4bit"):
        cache = torchkv.new_cache(model, max_cache_len=64)
        with pytest.raises(ValueError, match="max_cache_len"):
            model(input_ids=ids, **cache_argument(model, cache), use_cache=True)


def test_a_capacity_the_device_cannot_hold_is_refused_with_the_tokens_that_fit(monkeypatch):
    """Before allocating, the buffers of every layer are checked against the device's free memory (known on CUDA;
    here stated): too large a capacity is refused with the capacity that fits, and that capacity is accepted."""
    import torchkv.static_store

    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0)
    with torchkv.patched(model, "kivi-2bit"):
        cache = torchkv.new_cache(model, max_cache_len=4096)
        model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
        need = cache.nbytes()
        free = need // 3  # a device with a third of what 4,096 tokens take
        monkeypatch.setattr(torchkv.static_store, "free_bytes", lambda device: free)
        with pytest.raises(ValueError, match=r"max_cache_len=4096 does not fit on cpu: .* About \d+ tokens fit") as err:
            model(input_ids=ids, **cache_argument(model, torchkv.new_cache(model, max_cache_len=4096)), use_cache=True)
        fit = int(str(err.value).split("About ")[1].split(" tokens")[0])
        assert 0 < fit < 4096 and fit % 32 == 0
        cache = torchkv.new_cache(model, max_cache_len=fit)  # fits: allocated, and within what is free
        model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
        assert cache.nbytes() <= free
        assert [layer.static.layers_after for layer in cache.layers] == [1, 0]
        with pytest.raises(ValueError, match="does not fit"):  # one chunk more does not
            model(input_ids=ids, **cache_argument(model, torchkv.new_cache(model, max_cache_len=fit + 32)),
                  use_cache=True)


def test_the_capacity_check_counts_the_later_layers_on_each_device():
    """A model spread over devices: each layer's check counts only the layers after it on its own device."""
    from torchkv.models.cache import TorchKVCache

    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    cache = TorchKVCache(torchkv.KVPipeline.from_preset("kivi-2bit"), 5, max_cache_len=256, devices=[a, a, b, a, b])
    assert [layer.static.layers_after for layer in cache.layers] == [2, 1, 1, 0, 0]


@pytest.mark.parametrize("preset, reason", [
    ("subkv-2bit", "window policy"), ("svdq-1.25bit", "window policy"), ("xquant-2bit", "layer input"),
    ("squat-pre-2bit", "pre-RoPE"),
])
def test_presets_without_fixed_shapes_say_why_and_decode_per_layer(preset, reason):
    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0)
    with torchkv.patched(model, preset):
        with pytest.warns(UserWarning, match=f"(?s){reason}.*per-layer"):
            cache = torchkv.new_cache(model, max_cache_len=512)
        model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
    assert not cache.is_compileable
    assert cache.get_seq_length() == ids.shape[1]


def test_a_prompt_that_leaves_no_window_token_freezes():
    """No sinks and no full-precision window: after the prompt every token is encoded."""
    model = tiny_model("llama")
    ids, mask = _prompt(pad=0)
    cast = [T.quantize("cast", dtype="float32")]
    pipe = torchkv.KVPipeline(cast, cast, residual=0, chunk=8, compile=False)
    expected = _generate(model, ids, mask).sequences
    with torchkv.patched(model, pipe):
        out = _generate(model, ids, mask, cache_implementation="static")
    assert isinstance(out.past_key_values.layers[0].held, StaticKVStore)
    assert torch.equal(out.sequences, expected)


def test_benchmark_rows_of_the_whole_step():
    """`compiled:PRESET` rows decode with the compiled forward over a fixed-capacity cache (what
    `benchmarks/decode.py` times), and `static-compiled` is transformers' StaticCache."""
    from torchkv.eval.rows import method
    from torchkv.eval.speed import _run

    model = tiny_model("llama")
    ids, _ = _prompt(batch=1, pad=0)
    row = method("compiled:kivi-4bit:residual=32")
    with row.active(model):
        *_, cache = _run(model, row, ids, 3, capacity=200)
        graphs = counters["stats"]["unique_graphs"]
        _run(model, row, ids, 3, capacity=200)  # the row's next run (the benchmark's timed one) reuses its graph
    assert counters["stats"]["unique_graphs"] == graphs
    assert row.kind == "torchkv" and cache.is_compileable and cache.layers[0].frozen
    assert int(cache.get_seq_length()) == ids.shape[1] + 2 + 3  # the speed module's untimed steps, then the timed
    baseline = method("static-compiled")
    assert baseline.kind == "static" and isinstance(baseline.new_cache(model, max_cache_len=64), StaticCache)
    with pytest.raises(ValueError, match="max_cache_len"):
        baseline.new_cache(model)
    with pytest.raises(ValueError, match="only torchkv rows"):
        method("compiled:dynamic")
