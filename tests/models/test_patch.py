"""torchkv.patch on the real SmolLM2-135M-Instruct: generation anchors, memory, batches, errors."""

import random

import pytest
import torch
from transformers import DynamicCache

import torchkv
from torchkv.corpora import documents, split_text
from torchkv.models import cache_argument
from torchkv.testing import tiny_model

pytestmark = pytest.mark.model


def _agreement(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of two token sequences."""
    return int((a == b).long().cumprod(0).sum())


@pytest.fixture(scope="module")
def long_prompt(smollm2):
    _, tokenizer = smollm2
    return documents(tokenizer, 1000, 1)


@pytest.fixture(scope="module")
def reference_generation(smollm2, long_prompt):
    model, _ = smollm2
    return model.generate(long_prompt, attention_mask=torch.ones_like(long_prompt), max_new_tokens=64, do_sample=False)


def _generate(model, prompt, preset, n=64):
    with torchkv.patched(model, preset):
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False)


@pytest.mark.eager_first
def test_patch_returns_the_model_and_unpatch_restores_exact_logits(smollm2, long_prompt):
    model, _ = smollm2
    ids = long_prompt[:, :200]
    with torch.no_grad():
        before = model(ids).logits
        hooks = len(model._forward_pre_hooks)
        assert torchkv.patch(model, "kivi-2bit") is model
        torchkv.patch(model, "kivi-4bit")  # replaces, does not stack
        assert torchkv.pipeline_of(model).name == "kivi-4bit"
        assert len(model._forward_pre_hooks) == hooks + 1
        patched = model(ids, use_cache=True)
        assert isinstance(patched.past_key_values, torchkv.models.TorchKVCache)
        torchkv.unpatch(model)
        after = model(ids).logits
    assert torch.equal(before, after)
    assert len(model._forward_pre_hooks) == hooks and torchkv.pipeline_of(model) is None


@pytest.mark.eager_first
def test_fp16_preset_matches_dynamic_cache_for_64_tokens(smollm2, long_prompt, reference_generation):
    model, _ = smollm2
    got = _generate(model, long_prompt, "fp16")
    assert _agreement(got[0, 1000:], reference_generation[0, 1000:]) == 64


def test_fp16_preset_on_a_half_precision_model_matches_its_dynamic_cache(long_prompt):
    model, _ = torchkv.load_model(dtype=torch.float16)
    prompt = long_prompt[:, :600]
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, do_sample=False)
    got = _generate(model, prompt, "fp16")
    assert _agreement(got[0, 600:], expected[0, 600:]) == 64


def test_kivi_8bit_matches_for_32_tokens(smollm2, long_prompt, reference_generation):
    model, _ = smollm2
    got = _generate(model, long_prompt, "kivi-8bit")
    assert _agreement(got[0, 1000:], reference_generation[0, 1000:]) >= 32


def _passkey_prompt(tokenizer, seed: int):
    rng = random.Random(seed)
    code = str(rng.randint(10000, 99999))
    text = split_text("eval")
    start = rng.randint(0, len(text) - 5000)
    filler = text[start : start + 4400]
    prompt = (
        f"Remember the pass key. The pass key is {code}.\n\n{filler}\n\n"
        "Question: What is the pass key?\nAnswer: The pass key is"
    )
    return code, tokenizer(prompt, return_tensors="pt")


@pytest.mark.eager_first
def test_kivi_4bit_still_answers_a_fact_stated_early(smollm2):
    model, tokenizer = smollm2
    for seed in range(3):
        code, prompt = _passkey_prompt(tokenizer, seed)
        n = prompt["input_ids"].shape[1]
        assert n > 900
        with torchkv.patched(model, "kivi-4bit"):
            out = model.generate(**prompt, max_new_tokens=7, do_sample=False)
        assert code in tokenizer.decode(out[0, n:])


@torch.no_grad()
def _second_block_kl(model, ids, preset):
    """KL(full precision || compressed) of the logits of block 2, which attends to block 1 through the cache."""
    reference = torch.log_softmax(model(ids).logits[0, 256:], -1)
    with torchkv.patched(model, preset):
        cache = torchkv.new_cache(model)
        model(ids[:, :256], **cache_argument(model, cache))
        logits = model(ids[:, 256:], **cache_argument(model, cache)).logits[0]
    assert cache.layers[0].store.n_encoded == 512  # block 1 was compressed before block 2 read it
    return float(torch.nn.functional.kl_div(torch.log_softmax(logits, -1), reference, log_target=True, reduction="batchmean"))


@pytest.mark.eager_first
def test_residual_zero_really_compresses(smollm2, long_prompt):
    """With no full-precision window the output moves by what each bit width predicts: a silently
    uncompressed cache (KL = 0) fails, and so does a broken one (large KL at 8 bits)."""
    model, _ = smollm2
    ids = long_prompt[:, :512]
    kl = {
        bits: _second_block_kl(model, ids, torchkv.KVPipeline.from_preset(f"kivi-{bits}bit", residual=0))
        for bits in (8, 4, 2)
    }
    assert 1e-6 < kl[8] < 1e-3
    assert kl[8] < kl[4] < kl[2]
    assert 0.01 < kl[2] < 2.0


@pytest.mark.eager_first
def test_cache_bytes_after_generation(smollm2):
    model, tokenizer = smollm2
    prompt = documents(tokenizer, 2040, 1)
    with torchkv.patched(model, "kivi-2bit"):
        cache = torchkv.new_cache(model)
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                       **cache_argument(model, cache))
    assert cache.get_seq_length() == 2047  # the last generated token is never fed back
    held = [t for layer in cache.layers for t in layer.store.tensors().values()]
    assert cache.nbytes() == sum(t.untyped_storage().nbytes() for t in held)
    config = model.config
    fp16_bytes = 2048 * config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
    assert cache.nbytes() < 0.35 * fp16_bytes
    assert cache.encoded_bits_per_value() == pytest.approx(3.0)


@pytest.mark.eager_first
def test_left_padded_batch_gives_each_row_its_own_tokens(smollm2, long_prompt):
    model, _ = smollm2
    a, b = long_prompt[:, :300], long_prompt[:, 400:640]
    batch = torch.full((2, 300), 2, dtype=torch.long)
    batch[0], batch[1, 60:] = a[0], b[0]
    mask = torch.ones_like(batch)
    mask[1, :60] = 0
    for preset in ("fp16", "kivi-8bit"):
        with torchkv.patched(model, preset):
            both = model.generate(batch, attention_mask=mask, max_new_tokens=16, do_sample=False)
            alone_a = model.generate(a, attention_mask=torch.ones_like(a), max_new_tokens=16, do_sample=False)
            alone_b = model.generate(b, attention_mask=torch.ones_like(b), max_new_tokens=16, do_sample=False)
        assert torch.equal(both[0, 300:], alone_a[0, 300:]), preset
        assert torch.equal(both[1, 300:], alone_b[0, 240:]), preset


@pytest.mark.eager_first
def test_beam_search_and_sampling(smollm2, long_prompt):
    model, _ = smollm2
    prompt = long_prompt[:, :300]
    mask = torch.ones_like(prompt)
    beams = model.generate(prompt, attention_mask=mask, max_new_tokens=12, num_beams=3, do_sample=False)
    with torchkv.patched(model, "kivi-8bit"):
        got = model.generate(prompt, attention_mask=mask, max_new_tokens=12, num_beams=3, do_sample=False)
        torch.manual_seed(0)
        s1 = model.generate(prompt, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20)
        torch.manual_seed(0)
        s2 = model.generate(prompt, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20)
    assert torch.equal(got, beams)
    assert torch.equal(s1, s2) and s1.shape == (1, 312)


@pytest.mark.eager_first
def test_one_model_serves_many_generate_calls(smollm2, long_prompt):
    model, _ = smollm2
    prompt = long_prompt[:, :200]
    with torchkv.patched(model, "kivi-4bit"):
        runs = [model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
                for _ in range(3)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])


@pytest.mark.eager_first
def test_accelerate_device_map_keeps_each_layer_cache_on_its_device():
    """A model dispatched by accelerate, one device-map entry per layer (all "cpu" here, so the hooks that
    move tensors between devices run; on several GPUs each entry names its GPU)."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    from torchkv.models.loader import model_path

    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "cpu" for i in range(30)})
    model = AutoModelForCausalLM.from_pretrained(model_path(), local_files_only=True)
    model = dispatch_model(model, device_map=device_map, force_hooks=True)
    assert hasattr(model.model.layers[3], "_hf_hook")
    prompt = torch.arange(100, 300)[None]
    with torchkv.patched(model, "kivi-4bit"):
        cache = torchkv.new_cache(model)
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, **cache_argument(model, cache))
    for i, layer in enumerate(cache.layers):
        device = next(model.model.layers[i].parameters()).device
        assert all(t.device == device for t in layer.store.tensors().values())


def test_bad_input_is_refused_clearly(smollm2):
    model, _ = smollm2
    with pytest.raises(ValueError, match="unknown preset 'kivi-3bitt'.*available: .*kivi-2bit"):
        torchkv.patch(model, "kivi-3bitt")
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    with pytest.raises(TypeError, match="needs a Hugging Face causal LM"):
        torchkv.patch(BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)))
    with pytest.raises(NotImplementedError, match="model type 'gpt2'.*supported: .*llama"):
        torchkv.patch(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2)))
    with pytest.raises(ValueError, match="not patched"):
        torchkv.unpatch(tiny_model("llama"))
    with pytest.raises(ValueError, match="head_dim 64.*group=48 must divide"):
        torchkv.patch(model, torchkv.KVPipeline(
            [torchkv.transforms.quantize(bits=2, axis="token", group=48)], [torchkv.transforms.quantize("cast")]))
    assert torchkv.pipeline_of(model) is None


def test_a_filled_foreign_cache_is_refused(smollm2, long_prompt):
    model, _ = smollm2
    ids = long_prompt[:, :50]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_argument(model, cache))
        with torchkv.patched(model, "kivi-4bit"), pytest.raises(ValueError, match="holding 50 tokens"):
            model(ids[:, :1], **cache_argument(model, cache))


def test_without_a_cache_the_patched_model_attends_over_its_inputs(smollm2, long_prompt):
    model, _ = smollm2
    ids = long_prompt[:, :300]
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        with torchkv.patched(model, "kivi-2bit"):
            got = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-3)


@pytest.mark.eager_first
def test_generate_reads_and_writes_the_compressed_cache(smollm2, long_prompt):
    """generate() passes its cache as `cache` (transformers >= 5.24) or `past_key_values`: either way the
    generation runs through a torchkv cache that holds encoded tokens, not a DynamicCache beside it."""
    model, _ = smollm2
    prompt = long_prompt[:, :400]
    with torchkv.patched(model, "kivi-2bit"), torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True)
    assert isinstance(out.past_key_values, torchkv.models.TorchKVCache)
    assert out.past_key_values.layers[0].store.n_encoded > 0
