"""Heavy tokens: how much of what stored keys lose at long range would a few full-precision tokens per KV head save,
and which tokens (issue 41's dense-and-sparse candidate). A probe, not a stored form: nothing here is a pipeline.

`kl`: per layer, the prompt's keys (the first half of one document) encoded and rebuilt by a pipeline's key chain;
256 later queries (the second half, every 16th); the first-order KL divergence of each query's attention from its
score errors e, `½ Var_p(e)`, and the fraction of it left when the top 1% or 3% of encoded tokens per KV head, by a
criterion known when the prompt is encoded, are kept exact. Criteria: the code's error norm and the key's norm
(both in the balanced domain), the attention the prompt's last `OBSERVE` queries pay the token (SnapKV's
observation window), and the oracle (each token's own share of the later queries' KL).

    python benchmarks/heavy_tokens.py kl --domain code --out benchmarks/results/domains/ablations/heavy_tokens_kl_code.json

`eval`: `torchkv eval` with the top `--frac` of each layer's prompt-encoded tokens per KV head, by the observation
window's attention, kept exact (keys; values too with `--values`). Simulated: their exact rows overwrite the rebuilt
history that multi-token blocks read (`KVStore.history`), which is what prompt-mode perplexity reads; single-token
decode steps still read the codes only, so use it for `--ppl-prompt` runs.

    python benchmarks/heavy_tokens.py eval --frac 0.01 -- --presets DIR --domains wiki,code,docs --ppl-docs 8192:1 \
        --ppl-prompt 0.5 --retrieval-contexts none --speed-contexts none --out OUT
"""

import argparse
import json

import torch

import torchkv
from torchkv.corpora import documents
from torchkv.eval.runner import write_benchmark
from torchkv.models.capture import capture_qkv
from torchkv.pipeline import LayerState

#: prompt queries whose attention picks the heavy tokens (the end of the prompt)
OBSERVE = 512
FRACTIONS = (0.01, 0.03)


def observed_attention(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention the last `OBSERVE` queries of a prompt pay each of its tokens, averaged over them and over the query
    heads of each KV head: q `[B, Hq, T, D]`, k `[B, H, T, D]` -> `[B, H, T]`."""
    b, h, t, _ = k.shape
    g, w = q.shape[1] // h, min(OBSERVE, t)
    s = scaling * q[:, :, t - w :].float() @ k.float().repeat_interleave(g, 1).transpose(-1, -2)  # [B, Hq, W, T]
    causal = torch.arange(t, device=k.device)[None] <= torch.arange(t - w, t, device=k.device)[:, None]
    p = torch.softmax(s.masked_fill(~causal, -torch.inf), -1)
    return p.mean(2).unflatten(1, (h, g)).mean(2)


def _kl_terms(p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Each token's term of the first-order KL `½ Var_p(e)` of each query: p, e `[Hq, Q, T]` -> `[Hq, Q, T]`
    (summed over T: the KL per query)."""
    mean = (p * e).sum(-1, keepdim=True)
    return 0.5 * p * (e - mean) ** 2


@torch.no_grad()
def kl(args) -> None:
    model, tokenizer = torchkv.load_model()
    pipe = torchkv.KVPipeline.from_pretrained(args.pipeline).for_model(model)
    ids = documents(tokenizer, args.tokens, 1, "eval", args.domain)
    _, layers = capture_qkv(model, ids)
    prompt = args.tokens // 2
    later = torch.arange(prompt, args.tokens, 16)
    rows = []
    for layer, (q, k, _) in enumerate(layers):
        q, k = q.float(), k.float()
        h, g, d = k.shape[1], q.shape[1] // k.shape[1], k.shape[-1]
        scaling = d**-0.5
        chain = pipe.for_layer(layer).keys
        params = pipe.layer_params(layer)
        prepared = chain.prepare(k[:, :, :prompt], LayerState(params, {}, {"queries": q[:, :, :prompt]}), None)
        start, end = pipe.sinks, prompt - pipe.residual  # about what the prompt's store encodes
        own = LayerState(params, prepared, {})
        delta = torch.zeros_like(k)
        delta[:, :, start:end] = chain.decode(chain.encode(k[:, :, start:end], own, None), d, own) - k[:, :, start:end]
        w = prepared.get("0.balance", torch.ones(1, h, 1, d))
        ql = q[0][:, later]  # [Hq, Q, D]
        visible = torch.arange(args.tokens)[None] <= later[:, None]
        p = torch.softmax((scaling * ql @ k[0].repeat_interleave(g, 0).transpose(-1, -2)).masked_fill(~visible, -torch.inf), -1)
        e = scaling * ql @ delta[0].repeat_interleave(g, 0).transpose(-1, -2)  # [Hq, Q, T]
        terms = _kl_terms(p, e)
        base = terms.sum(-1)  # [Hq, Q]
        share = terms.sum(1).unflatten(0, (h, g)).sum(1)  # [H, T]
        criteria = {
            "code_error": (delta[0] * w[0]).norm(dim=-1), "key_norm": (k[0] * w[0]).norm(dim=-1),
            "observed_attention": observed_attention(q[:, :, :prompt], k[:, :, :prompt], scaling)[0], "oracle": share,
        }
        row = {"layer": layer, "key_bits": getattr(chain.transforms[chain.reader].config, "bits", None),
               "kl": float(base.mean())}
        for name, score in criteria.items():
            for fraction in FRACTIONS:
                top = start + score[:, start:end].topk(max(1, round(fraction * (end - start))), -1).indices  # [H, n]
                kept = torch.ones(h, args.tokens).scatter(1, top, 0.0).repeat_interleave(g, 0)[:, None]
                row[f"{name}@{fraction}"] = float(_kl_terms(p, e * kept).sum(-1).mean() / base.mean())
        rows.append(row)
        print(json.dumps(row), flush=True)
    total = sum(r["kl"] for r in rows)
    left = {name: sum(r["kl"] * r[name] for r in rows) / total for name in rows[0] if "@" in name}
    print("KL left, summed over layers:", json.dumps(left, indent=1))
    write_benchmark(args.out, "heavy_tokens_kl", rows, pipeline=args.pipeline, domain=args.domain,
                    tokens=args.tokens, observe=OBSERVE, kl_left=left)


def simulated_eval(args) -> None:
    """`torchkv eval` (`args.rest`) with each store's heavy prompt tokens kept exact in the rebuilt history."""
    from torchkv.cli import main
    from torchkv.store import KVStore

    append, history = KVStore.append, KVStore.history

    def append_and_pick(self, k, v, valid=None, positions=None, inputs=None, attention=None):
        first = self.length == 0
        append(self, k, v, valid, positions, inputs, attention)
        if not first:
            return
        self.heavy = None
        if inputs and "queries" in inputs and self.n_encoded:
            start, n = self.n_sinks, self.n_encoded
            score = observed_attention(inputs["queries"], k, k.shape[-1] ** -0.5)[:, :, start : start + n]
            at = (start + score.topk(max(1, round(args.frac * n)), -1).indices)[..., None].expand(-1, -1, -1, k.shape[-1])
            self.heavy = (at, k.gather(2, at), v.gather(2, at))

    def history_with_heavy(self):
        k, v = history(self)
        if getattr(self, "heavy", None) is not None:
            at, k_exact, v_exact = self.heavy
            k = k.scatter(2, at, k_exact.to(k.dtype))
            v = v.scatter(2, at, v_exact.to(v.dtype)) if args.values else v
        return k, v

    KVStore.append, KVStore.history = append_and_pick, history_with_heavy
    main(["eval", *args.rest])
    if "--out" in args.rest:  # the results say what was simulated
        path = args.rest[args.rest.index("--out") + 1]
        results = json.loads(open(path).read())
        results["meta"]["heavy_tokens"] = {"frac": args.frac, "values": args.values, "observe": OBSERVE,
                                           "simulated": "exact rows overwrite the rebuilt history (KVStore.history)"}
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    probe = commands.add_parser("kl")
    probe.add_argument("--pipeline", default="benchmarks/results/domains/tuned/frontier-2bit@2.5_mixed_3bit_keys")
    probe.add_argument("--domain", default="code")
    probe.add_argument("--tokens", type=int, default=8192)
    probe.add_argument("--out", required=True)
    run = commands.add_parser("eval")
    run.add_argument("--frac", type=float, required=True)
    run.add_argument("--values", action="store_true")
    run.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "kl":
        kl(args)
    else:
        args.rest = [a for a in args.rest if a != "--"]
        simulated_eval(args)


if __name__ == "__main__":
    main()
