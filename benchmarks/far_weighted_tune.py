"""A tuning objective that weights far reads further (issue 41's candidate): `torchkv tune` estimates each width's
cost as the next-token KL summed over every position of its calibration windows, each position weighing the same.
In a 2,048-token window a query reads at most about 1,900 encoded tokens, and the average one about 900, where a
query at 8K reads up to 8,000. Here position `i`'s KL weighs `n_i / mean(n)`, `n_i` the number of encoded keys it
reads (`exposed_pairs`), so the queries that read most of the store count most. The weighting is exact: the gradient
of `Σ_i w_i CE_i` is the model's hidden-state gradient scaled by `w_i` row by row, done here by a forward hook on the
decoder. An ablation, not a `torchkv tune` option: `sensitivity._sampled_gradients` is patched in this process.

    python benchmarks/far_weighted_tune.py -- --preset frontier-2bit --budget 2.5 --domain mixed --tokens 32768 \
        --seq-len 2048 --per-head --out OUT
"""

import argparse
import json
from pathlib import Path

import torch

from torchkv.fitting.tuning import sensitivity


def read_weights(exposed: torch.Tensor) -> torch.Tensor:
    """`[T]` float32: each query position's count of encoded keys read (the rows of `exposed` `[T, T]`), over its
    mean; zeros where no position reads any."""
    reads = exposed.sum(1, dtype=torch.float32)
    return reads / reads.mean() if reads.any() else reads


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient of `x` `[B, T, d]` scaled by `weights` `[T]` per position."""

    @staticmethod
    def forward(ctx, x, weights):
        ctx.save_for_backward(weights)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (weights,) = ctx.saved_tensors
        return grad * weights[:, None].to(grad.dtype), None


def weighted_gradients(sampled=sensitivity._sampled_gradients):
    """`sampled` (a `_sampled_gradients`) with each position's cross-entropy weighted by `read_weights(exposed)`."""

    def run(model, ids, probes, generator, draws, exposed):
        weights = read_weights(exposed).to(ids.device)

        def scale(module, args, output):
            output.last_hidden_state = _ScaleGradient.apply(output.last_hidden_state, weights)
            return output

        handle = model.get_decoder().register_forward_hook(scale)
        try:
            return sampled(model, ids, probes, generator, draws, exposed)
        finally:
            handle.remove()

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="`torchkv tune` arguments, after --")
    rest = [a for a in parser.parse_args(argv).rest if a != "--"]
    from torchkv.cli import main as cli

    sensitivity._sampled_gradients = weighted_gradients()
    cli(["tune", *rest])
    report = Path(rest[rest.index("--out") + 1]) / "tune.json"  # the report says how positions were weighed
    results = json.loads(report.read_text())
    results["position_weights"] = "encoded keys read, over their mean (benchmarks/far_weighted_tune.py)"
    report.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
