"""The architecture matrix on tiny random models: every supported family, GQA ratios, dtypes, padding."""

import pytest
import torch

import torchkv
import torchkv.transforms as T
from torchkv.models import arch as arch_module
from torchkv.models import cache_argument
from torchkv.testing import TINY_ARCHITECTURES, tiny_model

ARCHS = sorted(TINY_ARCHITECTURES)


def lossless(pre_rope: bool = False, residual: int = 8) -> torchkv.KVPipeline:
    """Exact storage (float32), eager: these tests are about the integration, not the kernels."""
    keys = [T.rotate("pre_rope")] if pre_rope else []
    keys.append(T.quantize("cast", dtype="float32"))
    return torchkv.KVPipeline(keys, [T.quantize("cast", dtype="float32")], residual=residual, chunk=8, compile=False)


def _prompt(batch=2, length=80, pad=0, seed=0):
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return ids, mask


def _generate(model, ids, mask, n=12):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_pipeline_generates_like_the_model(arch, kernel):
    model = tiny_model(arch)
    ids, mask = _prompt()
    expected = _generate(model, ids, mask)
    with torchkv.patched(model, lossless(), prefill_kernel=kernel):
        got = _generate(model, ids, mask)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3", "olmo2"])
def test_pre_rope_storage_is_lossless(arch):
    """Keys stored before RoPE and rotated back at their true positions (per layer type for Gemma 3)."""
    model = tiny_model(arch)
    ids, mask = _prompt(pad=5)
    expected = _generate(model, ids, mask)
    with torchkv.patched(model, lossless(pre_rope=True)):
        got = _generate(model, ids, mask)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_one_layer_that_reads_positions_gets_them(arch):
    """A pipeline whose only layer 1 stores pre-RoPE keys (a layer's chains of its own): the cache gives that layer
    the model's rotary embedding and only it tracks positions, and storage stays lossless."""
    model = tiny_model(arch)
    ids, mask = _prompt(pad=5)
    expected = _generate(model, ids, mask)
    plain, pre = lossless(), lossless(pre_rope=True)
    pipe = torchkv.KVPipeline(plain.keys.transforms, plain.values.transforms, residual=8, chunk=8, compile=False,
                              layers={1: (pre.keys.transforms, pre.values.transforms)})
    assert {"cos", "sin"} <= pipe.layers_require and not {"cos", "sin"} & pipe.requires
    with torchkv.patched(model, pipe):
        cache = torchkv.new_cache(model)
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             **cache_argument(model, cache))
    assert [layer.store.tracks_positions for layer in cache.layers] == [i == 1 for i in range(len(cache.layers))]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_layers_share_positions_and_rope_without_changing_a_token(arch, pad, monkeypatch):
    """A cache's layers share their position ids and a step's cos/sin, one `SharedRope` per rotary embedding (Gemma 3
    has two): greedy tokens through a lossy pipeline that reads positions equal those of layers that share nothing,
    and unpadded, each rotary embedding runs once where each layer ran it (a left-padded batch's row groups share
    nothing, and stay exact)."""
    model = tiny_model(arch, layers=6)
    ids, mask = _prompt(pad=pad)
    pipe = torchkv.KVPipeline.from_preset("frontier-2bit", rotary_center=True, residual=8, chunk=8, compile=False)
    kinds = len({id(fn) for fn in arch_module.rope_fns(model)})
    assert kinds == (2 if arch == "gemma3_text" else 1)
    shared_fns = arch_module.rope_fns
    own_fns = [arch_module.rope_fn(model, i) for i in range(6)]  # one function per layer: nothing shared
    results = {}
    for name, ropes in (("shared", shared_fns), ("own", lambda model: own_fns)):
        calls = []
        counted = {}  # a counting wrapper per function, so that layers sharing a function still share it

        def counting(model, ropes=ropes, counted=counted, calls=calls):
            return [counted.setdefault(id(fn), lambda p, fn=fn: calls.append(p.shape) or fn(p)) for fn in ropes(model)]

        monkeypatch.setattr(arch_module, "rope_fns", counting)
        with torchkv.patched(model, pipe):
            results[name] = (_generate(model, ids, mask), len(calls))
    assert torch.equal(results["shared"][0], results["own"][0])
    if not pad:
        assert results["shared"][1] * 6 <= results["own"][1] * kinds, results  # once a step per rotary embedding


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize("arch", ARCHS)
def test_left_padding_matches_rows_alone(arch, kernel):
    model = tiny_model(arch)
    ids, mask = _prompt(pad=11)
    with torchkv.patched(model, lossless(), prefill_kernel=kernel):
        batch = _generate(model, ids, mask)
        alone = _generate(model, ids[:1, 11:], mask[:1, 11:])
    assert torch.equal(batch[0, 11:], alone[0])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (8, 2), (8, 8)])
def test_gqa_ratios(heads, kv_heads):
    model = tiny_model("llama", heads=heads, kv_heads=kv_heads, head_dim=32)
    ids, mask = _prompt()
    expected = _generate(model, ids, mask)
    with torchkv.patched(model, lossless()):
        assert torch.equal(_generate(model, ids, mask), expected)
    with torchkv.patched(model, torchkv.KVPipeline.from_preset("kivi-8bit", residual=8, compile=False)):
        got = _generate(model, ids, mask)
    assert (got == expected).float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_dtypes(arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    ids, mask = _prompt(pad=3)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits.float()
        with torchkv.patched(model, torchkv.KVPipeline.from_preset("kivi-4bit", residual=8, group=16, compile=False)):
            cache = torchkv.new_cache(model)
            first = model(input_ids=ids[:, :48], attention_mask=mask[:, :48], **cache_argument(model, cache)).logits
            second = model(input_ids=ids[:, 48:], attention_mask=mask, **cache_argument(model, cache)).logits
    logits = torch.cat([first, second], 1).float()
    assert logits.dtype == torch.float32 and torch.isfinite(logits[1]).all()
    # block 2 attends to a 4-bit history: close to the model, not equal
    err = (logits[1] - reference[1]).abs().mean() / reference[1].abs().mean()
    assert err < (0.02 if dtype == torch.float32 else 0.1)


def test_sliding_window_shorter_than_the_fp_window_is_refused():
    model = tiny_model("mistral")  # window 48
    with pytest.raises(ValueError, match="sliding window \\(48 tokens\\).*use residual <= 15"):
        torchkv.patch(model, "kivi-4bit")


def test_sliding_layers_read_compressed_tokens_inside_the_window():
    model = tiny_model("mistral")
    ids, mask = _prompt(length=120)
    expected = _generate(model, ids, mask, n=20)
    with torchkv.patched(model, lossless(residual=8)):
        assert torch.equal(_generate(model, ids, mask, n=20), expected)


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize(("arch", "preset"), [("mistral", "kivi-2bit"), ("gemma3_text", "frontier-2bit")])
def test_sliding_layers_drop_what_the_window_passed(arch, preset, kernel, monkeypatch):
    """Sliding-window layers hold about one window of tokens, whatever the length, and give the logits of a cache that
    keeps every token: a left-padded prompt in two blocks (the second attends over a store that already dropped
    tokens), then greedy decode steps (frontier with its centre turned to each position)."""
    model = tiny_model(arch, layers=2 if arch == "mistral" else 6)  # Gemma 3: five sliding layers, one global
    options = {"rotary_center": True, "chunk": 8} if preset == "frontier-2bit" else {"group": 8}
    pipe = torchkv.KVPipeline.from_preset(preset, residual=8, sinks=2, compile=False, **options)
    ids, mask = _prompt(length=120, pad=5)
    windows = arch_module.sliding_windows(model)
    runs = {}
    for name, sliding in (("drops", windows), ("keeps", [None] * len(windows))):
        monkeypatch.setattr(arch_module, "sliding_windows", lambda model, sliding=sliding: sliding)
        with torch.no_grad(), torchkv.patched(model, pipe, prefill_kernel=kernel):
            cache = torchkv.new_cache(model)
            logits = [model(input_ids=ids[:, :70], attention_mask=mask[:, :70], **cache_argument(model, cache)).logits,
                      model(input_ids=ids[:, 70:], attention_mask=mask, **cache_argument(model, cache)).logits]
            token, attention = logits[-1][:, -1:].argmax(-1), mask
            for _ in range(40):
                attention = torch.cat([attention, torch.ones_like(token)], 1)
                logits.append(model(input_ids=token, attention_mask=attention, **cache_argument(model, cache)).logits)
                token = logits[-1][:, -1:].argmax(-1)
        runs[name] = (torch.cat(logits, 1), cache)
    torch.testing.assert_close(runs["drops"][0], runs["keeps"][0], rtol=1e-4, atol=1e-4)
    dropping, keeping = runs["drops"][1], runs["keeps"][1]
    for layer, window in zip(dropping.layers, windows):
        groups = [(g.layer.store, g.strip) for g in layer.row_groups or []] or [(layer.store, 0)]
        for store, strip in groups:  # row groups count their tokens after the pads they all share
            assert store.n_seen == 160 - strip
            if window is None:
                assert store.dropped == 0
            else:
                assert store.dropped > 0 and store.length <= window - 1 + store.pipeline.chunk - 1
    assert dropping.nbytes() < keeping.nbytes()
