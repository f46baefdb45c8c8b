"""Frontier on SmolLM2: the recommended preset, read directly from its codes by the compiled decode.

Prints how each layer's history is read (`explain`), the measured stored bits per value, the perplexity of a
held-out Wikipedia passage fed in 64-token blocks through the compressed cache beside full precision and
KIVI-2, and a greedy continuation.
"""

import argparse

import torch

import torchkv
from torchkv.corpora import documents
from torchkv.eval.perplexity import perplexity
from torchkv.eval.rows import method


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="frontier-2.5bit")
    parser.add_argument("--tokens", type=int, default=1024, help="passage length")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    model, tokenizer = torchkv.load_model()
    config = model.config
    pipe = torchkv.KVPipeline.from_preset(args.preset)
    print(pipe.explain(config.num_hidden_layers))
    head_dim = config.hidden_size // config.num_attention_heads
    bits = pipe.bits_per_value(config.num_key_value_heads, head_dim, layers=config.num_hidden_layers)
    print(f"{args.preset}: {bits.mean:.3f} stored bits per value (keys {bits.keys:.3f}, values {bits.values:.3f})")
    ids = documents(tokenizer, args.tokens, 1)
    for name in ("dynamic", "kivi-2bit", args.preset):
        print(f"{name}: perplexity {perplexity(model, ids, method(name), progress=False):.3f}")
    prompt = ids[:, : args.tokens // 2]
    with torchkv.patched(model, pipe), torch.no_grad():
        out = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(f"{args.preset} continues: {tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
