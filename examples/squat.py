"""SQuat on SmolLM2: keys whose quantization error stays out of the prompt's query subspace.

Runs one held-out Wikipedia passage through the model, prepares SQuat's query subspace from the
prompt's queries, and compares the logit error |q·(k̂ - k)| that later (decode-time) queries see with
SQuat's keys and with KIVI's plain per-channel keys at the same 2 bits; then generates with both.
"""

import argparse

import torchkv
from torchkv.corpora import documents
from torchkv.eval.reconstruction import held_out_logit_error, reconstruct_prompt
from torchkv.models.capture import capture_qkv


def mean_logit_error(pipe: torchkv.KVPipeline, model, layers, prompt: int) -> float:
    """Mean over layers of |q·(k̂ - k)| for the queries after the prompt against the prompt's encoded keys."""
    errors = [held_out_logit_error(q[:, :, prompt:], k[:, :, :prompt], k_hat)
              for (q, k, _), (_, k_hat, _) in zip(layers, reconstruct_prompt(pipe, model, layers, prompt))]
    return sum(errors) / len(errors)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=768, help="passage length; the first half is the prompt")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    model, tokenizer = torchkv.load_model()
    ids = documents(tokenizer, args.tokens, 1)
    prompt = args.tokens // 2 // 32 * 32
    _, layers = capture_qkv(model, ids)
    overrides = {"kivi-2bit": {"residual": 32}, "squat-2bit": {}}  # the same window; SQuat: r=5, λ=1e-3, g=D/2
    for name, options in overrides.items():
        pipe = torchkv.KVPipeline.from_preset(name, compile=False, **options)
        error = mean_logit_error(pipe, model, layers, prompt)
        print(f"{name}: {pipe.bits_per_value(3, 64).mean:.2f} bits/value, decode queries' mean |q·δ| = {error:.3f}")
    for name, options in overrides.items():
        with torchkv.patched(model, torchkv.KVPipeline.from_preset(name, **options)):
            out = model.generate(ids[:, :prompt], max_new_tokens=args.max_new_tokens, do_sample=False)
        print(f"{name} continues: {tokenizer.decode(out[0, prompt:], skip_special_tokens=True)!r}")

if __name__ == "__main__":
    main()
