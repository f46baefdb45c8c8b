"""How much of a layer's keys and values a linear predictor explains, for fast forms of AQUA-KV's prediction
(issue 41's candidate). A predictor whose residual keeps a fraction `r` of the target's variance cuts a
scale-invariant quantizer's error by `r`, worth `-log4(r)` bits (AQUA-KV §1.1). Each ridge predictor (`α = 1e-3`,
relative) is fitted per (layer, KV head) on `--domain`'s calibration split and scored on every evaluation domain,
with exact inputs: an upper bound on what reconstructed inputs give. The forms, and what decode would pay for them:

- `v_from_k`: `v = W·k + b` from the same token's post-RoPE key, the key the frontier stores. Linear in the stored
  key, so decode folds it: `Σ p·v = W·(Σ p·k̂) + b + Σ p·r̂`, one more weighted sum over the key codes.
- `v_from_pre_rope_k`: the same from the pre-RoPE key, which the frontier does not store (a reference).
- `k_from_previous_layer`: AQUA-KV's key predictor, from every KV head of the previous layer (post-RoPE, same
  token). Decode scores `Wᵀq` against each of the previous layer's heads' codes: `1 + H` lookup passes per key.
- `k_from_previous_head`: the same from the previous layer's head of the same index only: 2 lookup passes.

Then with coded inputs (`--preset`, default `frontier-2bit`), on the odd layers, as a layout would store them.
Each evaluation window's first `--prompt` tokens are coded; the queries after them score the keys
(`held_out_logit_error`, mean |q·(k̂ - k)|) and the key relative error is taken, for:

- `direct`: the preset as it is; `reference_direct`: `--reference` (default 3-bit keys), one more bit per key.
- `previous_head_residual`: each odd layer's keys predicted from the even layer's reconstructed keys of the same
  head (predictor fitted on reconstructions of the calibration text), only the residual coded. Same storage; decode
  scores both layers' codes.
- `rope_mean_residual`: the prediction is the head's mean pre-RoPE key (calibration) rotated to the token's
  position, `R_t·μ`. Same storage; decode adds `q·R_t·μ`, which depends on the position alone. Also with `μ` from
  the window's own prompt (`rope_mean_prompt_residual`), with only `μ`'s 4 largest rotary pairs (`_top4_`: 8
  multiply-adds a token), and with each head's mean value (calibration) taken off the values too
  (`rope_mean_and_value_mean_residual`; decode adds `μ_v·Σ p`).

    python benchmarks/prediction_headroom.py --out benchmarks/results/domains/ablations/prediction_headroom_smollm2.json
"""

import argparse
import json
import math

import torch

import torchkv
from torchkv.corpora import DOMAINS, documents
from torchkv.eval.reconstruction import held_out_logit_error, reconstruct_prompt
from torchkv.eval.rows import method
from torchkv.models.arch import rope_fn
from torchkv.models.capture import capture_qkv
from torchkv.ops.rope import apply_rope
from torchkv.ops.linalg import ridge_streamed

ALPHA = 1e-3
FORMS = ("v_from_k", "v_from_pre_rope_k", "k_from_previous_layer", "k_from_previous_head")


def activations(model, tokenizer, split: str, domain: str, windows: int, length: int):
    """Per layer `(k, v, k_pre)`, each `[H, N, D]` float64 over `windows` windows of `length` tokens."""
    per_window = []
    for ids in documents(tokenizer, length, windows, split, domain):
        _, layers = capture_qkv(model, ids[None], layer_inputs=True)
        rows = []
        for layer, (_, k, v, x) in zip(model.model.layers, layers):
            k_pre = layer.self_attn.k_proj(x[0]).view(x.shape[1], k.shape[1], -1).transpose(0, 1)
            rows.append((k[0], v[0], k_pre))
        per_window.append(rows)
    return [tuple(torch.cat([w[i][j] for w in per_window], 1).double() for j in range(3))
            for i in range(len(per_window[0]))]


def pairs(acts, layer: int, head: int, form: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(inputs [N, Din], target [N, D]) of one form at (layer, head), or None where the form has no input."""
    k, v, k_pre = acts[layer]
    if form == "v_from_k":
        return k[head], v[head]
    if form == "v_from_pre_rope_k":
        return k_pre[head], v[head]
    if layer == 0:
        return None
    previous = acts[layer - 1][0]
    if form == "k_from_previous_layer":
        return previous.transpose(0, 1).flatten(1), k[head]
    return previous[head], k[head]


def kept_variance(fit, test, form: str) -> list[list[float | None]]:
    """[layer][head] residual variance over target variance (centred) on `test`, predictor fitted on `fit`."""
    table = []
    for layer in range(len(fit)):
        row = []
        for head in range(fit[layer][0].shape[0]):
            train, held = pairs(fit, layer, head, form), pairs(test, layer, head, form)
            if train is None:
                row.append(None)
                continue
            weight, bias = ridge_streamed([train], ALPHA)
            x, y = held
            residual = y - (x @ weight.double() + bias.double())
            row.append(float(residual.pow(2).sum() / (y - y.mean(0)).pow(2).sum()))
        table.append(row)
    return table


def coded_keys(pipe, model, layers, prompt: int) -> list[torch.Tensor]:
    """Each layer's reconstructed first `prompt` keys `[1, H, prompt, D]` float64."""
    return [k_hat.double() for _, k_hat, _ in reconstruct_prompt(pipe, model, layers, prompt)]


def rotated_means(model, windows) -> list[torch.Tensor]:
    """Per layer, each head's mean pre-RoPE key `[H, D]` float64 over the captured windows."""
    means = []
    for layer in range(len(windows[0])):
        keys = []
        for layers in windows:
            k = layers[layer][1]
            cos, sin = rope_fn(model, layer)(torch.arange(k.shape[2])[None])
            keys.append(apply_rope(k, cos, -sin)[0].double())
        means.append(torch.cat(keys, 1).mean(1))
    return means


def rope_mean(model, mean: torch.Tensor, layer: int, tokens: int) -> torch.Tensor:
    """`R_t·μ` for t < tokens: a head's mean pre-RoPE key rotated to each position, `[1, H, tokens, D]`."""
    cos, sin = rope_fn(model, layer)(torch.arange(tokens)[None])
    return apply_rope(mean[None, :, None].expand(1, -1, tokens, -1), cos, sin).double()


def fit_pair_predictors(pipe, model, windows) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per odd layer, per head: ridge `(W [D, D], b [D])` from the even layer's reconstructed keys to its own,
    over every captured calibration window (each coded whole)."""
    batches: dict[tuple[int, int], list] = {}
    for layers in windows:
        tokens = layers[0][1].shape[2]
        coded = coded_keys(pipe, model, layers, tokens)
        for layer in range(1, len(layers), 2):
            for head in range(coded[layer].shape[1]):
                batches.setdefault((layer, head), []).append(
                    (coded[layer - 1][0, head], layers[layer][1][0, head].double()))
    fitted: dict[int, list] = {}
    for (layer, head), rows in sorted(batches.items()):
        fitted.setdefault(layer, []).append(ridge_streamed(rows, ALPHA))
    return fitted


def top_pairs(mean: torch.Tensor, pairs: int) -> torch.Tensor:
    """`mean` [H, D] with only each head's `pairs` largest rotary pairs (`d`, `d + D/2`) kept."""
    half = mean.shape[-1] // 2
    size = mean[:, :half].pow(2) + mean[:, half:].pow(2)  # [H, D/2]
    keep = torch.zeros_like(size).scatter_(1, size.topk(pairs, dim=1).indices, 1.0)
    return mean * keep.repeat(1, 2)


def residual_coded(pipe, model, layers, prompt: int, keys: dict[int, torch.Tensor],
                   values: dict[int, torch.Tensor] | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """`(prediction + coded(k - prediction), same for v)` of the first `prompt` tokens of every layer, where the
    key prediction is `keys[layer]` (none: 0) and the value prediction `values[layer]` `[1, H, 1, D]` (none: 0)."""
    shifted = list(layers)
    zero = torch.zeros((), dtype=torch.float64)
    for layer, guess in keys.items():
        q, k, v, *rest = layers[layer]
        v_guess = (values or {}).get(layer, zero)
        shifted[layer] = (q, (k[:, :, :prompt].double() - guess).to(k.dtype),
                          (v[:, :, :prompt].double() - v_guess).to(v.dtype), *rest)
    return {layer: (keys.get(layer, zero) + k_hat.double(), (values or {}).get(layer, zero) + v_hat.double())
            for layer, (_, k_hat, v_hat) in enumerate(reconstruct_prompt(pipe, model, shifted, prompt))}


def odd_layer_errors(pipe, reference, model, layers, predictors, means, value_means, prompt: int
                     ) -> dict[str, dict[str, float]]:
    """The odd layers' held-out logit error and key and value relative errors, per way of storing them."""
    odd = list(predictors)
    direct = residual_coded(pipe, model, layers, prompt, {})
    from_previous = {layer: torch.stack([direct[layer - 1][0][0, h] @ w.double() + b.double()
                                         for h, (w, b) in enumerate(predictors[layer])])[None] for layer in odd}
    prompt_means = []
    for layer in range(len(layers)):
        k = layers[layer][1][:, :, :prompt]
        cos, sin = rope_fn(model, layer)(torch.arange(prompt)[None])
        prompt_means.append(apply_rope(k, cos, -sin)[0].double().mean(1))
    rotated = {name: {layer: rope_mean(model, source[layer], layer, prompt) for layer in odd}
               for name, source in (("calibration", means), ("prompt", prompt_means),
                                    ("top4", [top_pairs(m, 4) for m in means]))}
    by_form = {
        "direct": direct,
        "reference_direct": residual_coded(reference, model, layers, prompt, {}),
        "previous_head_residual": residual_coded(pipe, model, layers, prompt, from_previous),
        "rope_mean_residual": residual_coded(pipe, model, layers, prompt, rotated["calibration"]),
        "rope_mean_prompt_residual": residual_coded(pipe, model, layers, prompt, rotated["prompt"]),
        "rope_mean_top4_residual": residual_coded(pipe, model, layers, prompt, rotated["top4"]),
        "rope_mean_and_value_mean_residual": residual_coded(
            pipe, model, layers, prompt, rotated["calibration"],
            {layer: value_means[layer][None, :, None] for layer in odd}),
    }
    result = {}
    for form, coded in by_form.items():
        logit = k_err = k_norm = v_err = v_norm = 0.0
        for layer in odd:
            q, k, v = (t.double() for t in layers[layer][:3])
            q, k, v = q[:, :, prompt:], k[:, :, :prompt], v[:, :, :prompt]
            k_hat, v_hat = coded[layer]
            logit += held_out_logit_error(q, k, k_hat) / len(odd)
            k_err, k_norm = k_err + float((k_hat - k).pow(2).sum()), k_norm + float(k.pow(2).sum())
            v_err, v_norm = v_err + float((v_hat - v).pow(2).sum()), v_norm + float(v.pow(2).sum())
        result[form] = {"logit_error": logit, "key_rel_error": (k_err / k_norm) ** 0.5,
                        "value_rel_error": (v_err / v_norm) ** 0.5}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--domain", default="mixed", help="calibration domain of the predictors")
    parser.add_argument("--fit-windows", type=int, default=4)
    parser.add_argument("--test-windows", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--preset", default="frontier-2bit", help="the coder of the second measurement")
    parser.add_argument("--reference", default="frontier-2bit:key_bits=3", help="a direct coder to compare with")
    parser.add_argument("--prompt", type=int, default=1024, help="tokens coded of each evaluation window")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    model, tokenizer = torchkv.load_model(args.model)
    with torch.no_grad():
        fit = activations(model, tokenizer, "calibration", args.domain, args.fit_windows, args.length)
        pipe = method(args.preset).pipeline
        pipe.compile = False
        calibration = [capture_qkv(model, ids[None])[1] for ids in
                       documents(tokenizer, args.length, args.fit_windows, "calibration", args.domain)]
        predictors = fit_pair_predictors(pipe, model, calibration)
        means = rotated_means(model, calibration)
        value_means = [torch.cat([w[layer][2][0] for w in calibration], 1).double().mean(1)
                       for layer in range(len(calibration[0]))]
        reference = method(args.reference).pipeline
        reference.compile = False
        result = {"model": args.model, "calibration_domain": args.domain, "alpha": ALPHA,
                  "fit_tokens": args.fit_windows * args.length, "test_tokens": args.test_windows * args.length,
                  "preset": args.preset, "reference": args.reference, "prompt": args.prompt, "domains": {}}
        for name in DOMAINS:
            test = activations(model, tokenizer, "eval", name, args.test_windows, args.length)
            forms = {}
            for form in FORMS:
                table = kept_variance(fit, test, form)
                cells = [r for row in table for r in row if r is not None]
                mean = sum(cells) / len(cells)
                forms[form] = {"kept_variance_mean": mean, "equivalent_bits": -math.log(mean, 4),
                               "kept_variance_by_layer_head": table}
                print(f"{name:5s} {form:22s} kept {mean:.3f}  worth {-math.log(mean, 4):.2f} bits")
            windows = [odd_layer_errors(pipe, reference, model, capture_qkv(model, ids[None])[1], predictors, means,
                                        value_means, args.prompt)
                       for ids in documents(tokenizer, args.length, args.test_windows, "eval", name)]
            forms["odd_layers_coded"] = {
                form: {key: sum(w[form][key] for w in windows) / len(windows) for key in windows[0][form]}
                for form in windows[0]}
            for form, row in forms["odd_layers_coded"].items():
                print(f"{name:5s} odd layers {form:22s} logit error {row['logit_error']:.3f}  "
                      f"key rel. error {row['key_rel_error']:.3f}")
            result["domains"][name] = forms
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
