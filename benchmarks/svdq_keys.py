"""SVDq's central claim on SmolLM2's real keys: key reconstruction error of every SVDq schedule against
per-channel quantization of the same keys in the original space (paper Table 1 style).

A held-out passage runs once through the unpatched model; its first `--prompt` tokens' keys (all 30
layers) are encoded and reconstructed. Reported: ‖k̂ - k‖/‖k‖, and stored bits per key value: the
encoded codes and metadata, and the per-sequence basis and mean spread over this prompt's keys.

    python benchmarks/svdq_keys.py --out benchmarks/results/svdq_keys.json
"""

import argparse

import torch

import torchkv
from torchkv.corpora import documents
from torchkv.eval.reconstruction import key_rel_error, per_channel_keys
from torchkv.eval.runner import write_benchmark
from torchkv.models.arch import rope_fn
from torchkv.models.capture import capture_qkv

BASELINES = {"per-channel-2bit": (2, 128), "per-channel-3bit": (3, 128), "per-channel-2bit-g32": (2, 32)}


def key_bits(pipe, model, layers, prompt: int) -> tuple[float, float]:
    """(encoded bits per key value, from real stored tensors; prepared-state bits per key value of this
    prompt: every layer prepares tensors of the same shapes)."""
    k = layers[0][1][:, :, :prompt]
    encoded = pipe.bits_per_value(k.shape[1], k.shape[-1]).keys
    if not pipe.needs_prepare:
        return encoded, 0.0
    cos, sin = rope_fn(model, 0)(torch.arange(prompt)[None])
    state = pipe.prepare(k, k, inputs={"cos": cos, "sin": sin})
    prepared = sum(t.numel() * t.element_size() for n, t in state.items() if n.startswith("k."))
    return encoded, 8 * prepared / k.numel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=1024, help="keys encoded (a multiple of 128)")
    parser.add_argument("--out", default="benchmarks/results/svdq_keys.json")
    args = parser.parse_args(argv)
    model, tokenizer = torchkv.load_model()
    _, layers = capture_qkv(model, documents(tokenizer, args.prompt, 1))
    pipes = {name: per_channel_keys(bits, group) for name, (bits, group) in BASELINES.items()}
    pipes["kivi-2bit (post-RoPE, G=32)"] = torchkv.KVPipeline.from_preset("kivi-2bit", residual=0, compile=False)
    for p in torchkv.presets():
        if p["name"].startswith("svdq-") and not p["name"].endswith("-v4"):
            pipes[p["name"]] = torchkv.KVPipeline.from_preset(p["name"], compile=False)
    rows = []
    print("| keys | rel. error | vs per-channel 2-bit | encoded bits/key | + basis, mean bits/key |")
    print("|---|---|---|---|---|")
    reference = None
    for name, pipe in pipes.items():
        error = key_rel_error(pipe, model, layers, args.prompt)
        reference = reference or error
        encoded, prepared = key_bits(pipe, model, layers, args.prompt)
        rows.append({"keys": name, "key_rel_error": error, "ratio_to_per_channel_2bit": error / reference,
                     "encoded_bits_per_key": encoded, "prepared_bits_per_key": prepared})
        print(f"| {name} | {error:.4f} | {error / reference:.3f} | {encoded:.3f} | {encoded + prepared:.3f} |",
              flush=True)
    write_benchmark(args.out, "svdq_keys", rows, prompt=args.prompt)


if __name__ == "__main__":
    main()
