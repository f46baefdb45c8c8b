"""Balance scales from more than the prompt (issue 41's candidate): `project.balance` takes each key channel pair's
scale `(rms q / rms k)^½` from the prompt alone, which in streaming use (a short prompt, then token after token) is
the first block's few tokens. Here each layer's calibration keys and queries (`--prior-tokens` of them, post-RoPE,
from `--prior-domain`'s calibration split, disjoint from every evaluation split) are pooled with the prompt's
before the scales are taken: the mean squares become `(n₀·m_cal + n·m_prompt) / (n₀ + n)`, so a 64-token prompt
leans on the calibration text and a 4K-token one on itself. An ablation, not a stored form: the stores' `prepare`
is patched in this process, so compare with a run of the same `torchkv eval` arguments without it.

    python benchmarks/balance_prior.py --prior-tokens 2048 -- --presets frontier-2bit --domains wiki,code,docs \
        --ppl-docs 2048:2,8192:1 --retrieval-contexts none --speed-contexts none --out OUT
"""

import argparse
import json

import torch

import torchkv
from torchkv.corpora import documents
from torchkv.models.capture import capture_qkv
from torchkv.pipeline import KVPipeline

#: calibration tokens per captured window
WINDOW = 1024


def calibration_qkv(model_name: str, tokens: int, domain: str) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's post-RoPE calibration queries `[1, Hq, tokens, D]`, keys and values `[1, H, tokens, D]` float32,
    from `tokens // WINDOW` windows of `domain`'s calibration split."""
    model, tokenizer = torchkv.load_model(model_name)
    ids = documents(tokenizer, WINDOW, tokens // WINDOW, "calibration", domain)
    _, layers = capture_qkv(model, ids)
    return [tuple(t.float().transpose(0, 1).flatten(1, 2)[None] for t in qkv) for qkv in layers]


def pooled_prepare(prior: list[tuple[torch.Tensor, ...]], prepare=KVPipeline.prepare):
    """`prepare` (a `KVPipeline.prepare`) that reads layer `l`'s prior queries, keys and values `prior[l]` after the
    prompt's, as if they were more prompt tokens."""

    def pooled(self, k, v, *, layer=0, valid=None, inputs=None):
        q0, k0, v0 = (t.to(k.device).expand(k.shape[0], -1, -1, -1) for t in prior[layer])
        inputs = dict(inputs or {})
        if inputs.get("queries", q0).shape[1] != q0.shape[1]:  # `bits_per_value`'s probe: bits do not read scales
            return prepare(self, k, v, layer=layer, valid=valid, inputs=inputs)
        if "queries" in inputs:
            inputs["queries"] = torch.cat([inputs["queries"].float(), q0], 2)
        if valid is not None:
            valid = torch.cat([valid, valid.new_ones(k.shape[0], k0.shape[2])], 1)
        return prepare(self, torch.cat([k.float(), k0], 2), torch.cat([v.float(), v0], 2), layer=layer, valid=valid,
                       inputs=inputs)

    return pooled


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prior-tokens", type=int, required=True)
    parser.add_argument("--prior-domain", default="mixed")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    rest = [a for a in args.rest if a != "--"]
    from torchkv.cli import main as cli

    KVPipeline.prepare = pooled_prepare(calibration_qkv(args.model, args.prior_tokens, args.prior_domain))
    cli(["eval", "--model", args.model, *rest])
    if "--out" in rest:  # the results say what was pooled
        path = rest[rest.index("--out") + 1]
        results = json.loads(open(path).read())
        results["meta"]["balance_prior"] = {"tokens": args.prior_tokens, "domain": args.prior_domain,
                                            "split": "calibration", "windows_of": WINDOW}
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
