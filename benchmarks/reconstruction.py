"""Every preset on SmolLM2's real keys, values and queries: stored bits, reconstruction error, logit error.

A held-out Wikipedia passage runs once through the unpatched model. Its first `--prompt` tokens are
the prompt: each preset prepares on them (SQuat's subspace comes from their queries) and encodes them.
Reported per preset, over all 30 layers: measured bits per value, relative error ‖x̂ - x‖/‖x‖ of keys
and values, stored bytes against fp16, and the mean |q·(k̂ - k)| of the queries of the tokens *after*
the prompt (decode-time queries no preset has seen) against the prompt's keys; and each layer's key
relative error (does it grow with depth? cross-layer methods).

    python benchmarks/reconstruction.py --out benchmarks/results/reconstruction.json
"""

import argparse


import torchkv
from torchkv.corpora import documents
from torchkv.eval.reconstruction import held_out_logit_error, reconstruct_prompt
from torchkv.eval.rows import method
from torchkv.eval.runner import write_benchmark
from torchkv.models.capture import capture_qkv


def measure(pipe, model, layers, prompt: int) -> dict:
    err_k = err_v = norm_k = norm_v = logit = 0.0
    stored = values = 0
    by_layer = []
    pipe = pipe.for_model(model)
    for (q, k, v, *_), (state, k_hat, v_hat) in zip(layers, reconstruct_prompt(pipe, model, layers, prompt)):
        q, k, v = q[:, :, prompt:], k[:, :, :prompt], v[:, :, :prompt]
        by_layer.append(float((k_hat - k).norm() / k.norm()))
        err_k += float((k_hat - k).pow(2).sum())
        err_v += float((v_hat - v).pow(2).sum())
        norm_k += float(k.pow(2).sum())
        norm_v += float(v.pow(2).sum())
        logit += held_out_logit_error(q, k, k_hat)
        stored += sum(t.numel() * t.element_size() for t in state.values())
        values += 2 * k.numel()
    bits = pipe.bits_per_value(layers[0][1].shape[1], layers[0][1].shape[-1], layers=len(layers))
    return {
        "bits_per_value": bits.mean,
        "key_rel_error": (err_k / norm_k) ** 0.5,
        "value_rel_error": (err_v / norm_v) ** 0.5,
        "bytes_vs_fp16": stored / (2 * values),
        "held_out_logit_error": logit / len(layers),
        "key_rel_error_by_layer": by_layer,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="passage length")
    parser.add_argument("--prompt", type=int, default=512, help="tokens encoded (a multiple of every chunk)")
    parser.add_argument("--presets", default=",".join(p["name"] for p in torchkv.presets() if not p["calibrate"]),
                        help="presets (with overrides after colons) or calibrated pipeline folders")
    parser.add_argument("--out", default="benchmarks/results/reconstruction.json")
    args = parser.parse_args(argv)
    model, tokenizer = torchkv.load_model()
    _, layers = capture_qkv(model, documents(tokenizer, args.tokens, 1), layer_inputs=True)
    rows = []
    print("| preset | bits/value | K rel. error | V rel. error | bytes vs fp16 | held-out mean abs(q·δ) |")
    print("|---|---|---|---|---|---|")
    for name in args.presets.split(","):
        pipe = method(name).pipeline
        pipe.compile = False
        row = {"preset": name, **measure(pipe, model, layers, args.prompt)}
        rows.append(row)
        print(f"| {name} | {row['bits_per_value']:.2f} | {row['key_rel_error']:.4f} | {row['value_rel_error']:.4f} "
              f"| {row['bytes_vs_fp16']:.3f} | {row['held_out_logit_error']:.4f} |", flush=True)
    write_benchmark(args.out, "reconstruction", rows, tokens=args.tokens, prompt=args.prompt)


if __name__ == "__main__":
    main()
