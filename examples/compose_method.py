"""Write a new method by composing registered transforms, register it as a preset, evaluate it beside KIVI.

The new method rotates keys and values with a Hadamard transform (spreading outlier channels over all
channels) and then quantizes both per token, KIVI-style groups of 32, 2 bits.
"""

import argparse

import torchkv
import torchkv.transforms as T
from torchkv.corpora import documents
from torchkv.eval.perplexity import perplexity
from torchkv.eval.rows import method


@torchkv.register_preset(
    "hadamard-2bit", description="Hadamard-rotated keys and values, 2-bit per-token groups", nominal_bits=2.0
)
def hadamard_2bit(residual: int = 128, group: int = 32) -> torchkv.KVPipeline:
    return torchkv.KVPipeline(
        keys=[T.rotate("hadamard"), T.quantize(bits=2, axis="token", group=group), T.pack()],
        values=[T.rotate("hadamard"), T.quantize(bits=2, axis="token", group=group), T.pack()],
        residual=residual,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    args = parser.parse_args(argv)

    print(torchkv.KVPipeline.from_preset("hadamard-2bit"))
    model, tokenizer = torchkv.load_model()
    docs = documents(tokenizer, args.length, args.docs)
    reference = perplexity(model, docs, method("dynamic"), progress=False)
    print(f"{'row':<16} {'bits/value':>10} {'ppl':>8} {'increase':>9}")
    print(f"{'full precision':<16} {32:>10} {reference:>8.3f} {0:>8.2f}%")
    for name in ("kivi-2bit", "hadamard-2bit"):
        row = method(name)
        ppl = perplexity(model, docs, row, progress=False)
        bits = row.pipeline.bits_per_value(model.config.num_key_value_heads, model.config.head_dim).mean
        print(f"{name:<16} {bits:>10.2f} {ppl:>8.3f} {100 * (ppl / reference - 1):>8.2f}%")


if __name__ == "__main__":
    main()
