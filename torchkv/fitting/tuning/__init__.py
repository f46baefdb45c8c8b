"""`torchkv tune`: per-layer, per-K/V widths of a pipeline, chosen by measured sensitivity to meet a bit budget.

Each layer's keys and values may take any candidate width of the pipeline's own chains (`candidates`); the cost
of each is its estimated next-token KL divergence on calibration text (`sensitivity`), and the choice that
minimises the summed cost within the budget of stored bits per value is exact (`allocate`).

A model with sliding-window layers (Gemma 2 and 3) holds at most a window of tokens in those, and every token in
its other layers: its cache's bits per value are the mean over layers while the context is within the window, and
tend to the mean over the full layers beyond it. Both means are kept within the budget, so the budget holds at every
context.
"""

import collections
import json
import time
import weakref
from collections.abc import Sequence
from typing import Any


from torchkv import registry
from torchkv._compat import config_head_dim
from torchkv.corpora import DEFAULT_DOMAIN
from torchkv.memory import peak_rss, reset_peak
from torchkv.models.arch import full_layers
from torchkv.pipeline import HeadGroups, KVPipeline
from torchkv.pipeline.presets import spelling
from torchkv.fitting.tuning.allocate import allocate
from torchkv.fitting.tuning.candidates import CANDIDATE_BITS, Candidate, candidates, layer_candidates, tuned_chunk
from torchkv.fitting.tuning.sensitivity import Sensitivity, measure
from torchkv.fitting.tuning.unbiased import unbiased_values

#: bits per value of an uncompressed (float16) cache: a budget above it is an error
FULL_PRECISION = 16.0
#: tokens per calibration window. A query in a longer window reads more compressed tokens, as at the contexts
#: served: frontier-2bit tuned to 2.5 bits on mixed text in 2,048-token windows lost +1.17/+1.81/+1.94% perplexity
#: at 2K (wiki/code/docs), against +1.58/+2.52/+2.53% in 1,024-token windows (benchmarks/results/domains/)
SEQ_LEN = 2048

__all__ = ["CANDIDATE_BITS", "SEQ_LEN", "Candidate", "Sensitivity", "candidates", "measure", "allocate", "tune", "tuned_pipeline",
           "tuned_for_model", "check_tunable", "check_budget", "reachable", "bits_range", "calibration_sensitivity",
           "tuned_on_calibration_split", "stored_bits", "unbiased_values"]


def check_tunable(pipe: KVPipeline, model) -> KVPipeline:
    """`pipe` for `model`, calibrated for it; a clear error where it must be calibrated first."""
    from torchkv.models.arch import fingerprint

    pipe = pipe.for_model(model)
    config = model.config.get_text_config(decoder=True)
    if pipe.needs_fit:
        pipe.check_fitted(config.num_hidden_layers, fingerprint(model))  # asks for `torchkv calibrate` when unfitted
    return pipe


def reachable(pipe: KVPipeline, model, also: Sequence[KVPipeline] = ()) -> tuple[float, float]:
    """Least and most stored bits per value (mean over layers, keys and values) the candidates (of `pipe` and
    `also`) reach on `model`."""
    config = model.config.get_text_config(decoder=True)
    return bits_range(layer_candidates(pipe, config.num_hidden_layers, config.num_key_value_heads,
                                       config_head_dim(config), also), full_layers(model))


def bits_range(options: list[dict[str, list[Candidate]]], full: Sequence[int] = ()) -> tuple[float, float]:
    """Least and most stored bits per value (mean over layers, keys and values) of each layer's candidates by side,
    cheapest first; the least is also the least mean over the layers `full`, where given (a budget holds both)."""
    ends = [[sum(side[end].bits for layer in part for side in layer.values()) / (2 * len(part)) for end in (0, -1)]
            for part in (options, [options[i] for i in full]) if part]
    return max(low for low, _ in ends), ends[0][1]


def check_budget(budget: float, low: float, high: float) -> None:
    if not low <= budget <= FULL_PRECISION:
        raise ValueError(f"budget={budget:g} bits per value is outside what tuning can meet: the candidate settings "
                         f"reach {low:.4g} to {high:.4g} bits per value (full precision is {FULL_PRECISION:g})")


def stored_bits(report: dict[str, Any]) -> str:
    """A tuning report's stored bits per value, and where the model has sliding-window layers, its full layers'."""
    full = report.get("full_layer_bits_per_value")
    beyond = "" if full is None else f" ({full:.4g} in the layers without a sliding window)"
    return f"{report['bits_per_value']:.4g} stored bits per value{beyond}"


def tuned_pipeline(sensitivity: Sensitivity, budget: float, per_head: bool = False, full: Sequence[int] = ()
                   ) -> tuple[KVPipeline, dict[str, Any]]:
    """The pipeline whose per-layer, per-side candidates (`per_head`: per layer, side and KV head, from
    `Sensitivity.head_costs`) minimise the summed estimated KL within `budget` stored bits per value (mean over
    layers, keys and values, and heads; and over the layers `full`, see the module docstring), and a report of the
    choice. A side whose heads take different candidates is stored as `HeadGroups`, one group per candidate."""
    base = sensitivity.pipeline
    if per_head and not sensitivity.head_costs:
        raise ValueError("per-head widths need the sensitivity split by KV head, which a sensitivity read back from a "
                         "report lacks: measure it again (torchkv tune --per-head)")
    heads = len(sensitivity.head_costs[0]["k"][0]) if per_head else 1
    layers = range(len(sensitivity.costs))
    items = [(layer, side, h) for layer in layers for side in ("k", "v") for h in range(heads)]
    bits = [[c.bits for c in sensitivity.candidates[layer][side]] for layer, side, _ in items]
    costs = [[float(c[h]) for c in sensitivity.head_costs[layer][side]] if per_head else sensitivity.costs[layer][side]
             for layer, side, h in items]
    picked = allocate(bits, costs, budget, within=[i for i, (layer, _, _) in enumerate(items) if layer in set(full)])
    item_costs = dict(zip(items, costs))
    choice: dict[tuple[int, str], list[int]] = collections.defaultdict(list)  # each head's candidate, by layer, side
    for (layer, side, _), j in zip(items, picked):
        choice[layer, side].append(j)
    #: the heads that took each chosen candidate, by layer and side
    grouped = {key: {j: [h for h, i in enumerate(per) if i == j] for j in sorted(set(per))}
               for key, per in choice.items()}

    def chosen(layer: int, side: str) -> list | HeadGroups:
        options, groups = sensitivity.candidates[layer][side], grouped[layer, side]
        if len(groups) == 1:
            return list(options[next(iter(groups))].transforms)
        return HeadGroups([(heads, list(options[j].transforms)) for j, heads in groups.items()])

    used = [sensitivity.candidates[layer][side][j] for (layer, side, _), j in zip(items, picked)]
    pairs = collections.Counter((sensitivity.candidates[layer]["k"][choice[layer, "k"][h]],
                                 sensitivity.candidates[layer]["v"][choice[layer, "v"][h]])
                                for layer in layers for h in range(heads))
    main_k, main_v = pairs.most_common(1)[0][0]
    pipe = KVPipeline(list(main_k.transforms), list(main_v.transforms),
                      layers={i: (chosen(i, "k"), chosen(i, "v")) for i in layers},
                      residual=base.residual, sinks=base.sinks, chunk=tuned_chunk(base, [c.transforms for c in used]),
                      window=base.window, compile=base.compile)
    pipe.name, pipe.options, pipe.fitted_for = f"tuned:{base.name}@{budget:g}", dict(base.options), base.fitted_for
    pipe.fitted_on = base.fitted_on

    def summary(layer: int, side: str) -> dict[str, Any]:
        options, per = sensitivity.candidates[layer][side], choice[layer, side]
        labels = {options[j].label: heads for j, heads in grouped[layer, side].items()}
        cost = sum(item_costs[layer, side, h][j] for h, j in enumerate(per))
        return {"label": next(iter(labels)) if len(labels) == 1 else labels,
                "bits": sum(options[j].bits for j in per) / len(per), "kl": cost}

    rows = [(i, summary(i, "k"), summary(i, "v")) for i in layers]
    report = {
        "budget": budget,
        "per_head": per_head,
        "bits_per_value": sum(b[j] for b, j in zip(bits, picked)) / len(items),
        **({"full_layers": list(full),
            "full_layer_bits_per_value": sum(k["bits"] + v["bits"] for i, k, v in rows if i in full) / (2 * len(full))}
           if full else {}),
        "predicted_kl": sum(c[j] for c, j in zip(costs, picked)),
        "layers": [{"layer": i, "keys": k["label"], "values": v["label"], "key_bits": k["bits"],
                    "value_bits": v["bits"], "key_kl": k["kl"], "value_kl": v["kl"]} for i, k, v in rows],
    }
    return pipe, report


@registry.register_delegate("tune")
def tune(
    pipe: KVPipeline,
    model,
    texts,
    *,
    budget: float,
    tokenizer=None,
    seq_len: int = SEQ_LEN,
    max_tokens: int = 32768,
    batch: int = 1,
    progress: bool = True,
    domain: str | None = None,
    per_head: bool = False,
    also: Sequence[KVPipeline] = (),
) -> tuple[KVPipeline, dict[str, Any]]:
    """Tune `pipe` on `model` for a budget of stored bits per value (see the module docstring).

    Args:
        pipe: the pipeline to start from (a preset, or a calibrated folder's pipeline).
        texts: calibration strings (tokenized with `tokenizer`, cut into `seq_len`-token windows) or ids [N, T].
        max_tokens: calibration tokens used at most; batch: windows per forward and backward pass.
        domain: what the texts are (a `torchkv.corpora` domain or your own label), kept as `tuned.tuned_on`.
        per_head: choose each KV head's widths, not each layer's (`tuned_pipeline`).
        also: pipelines with the same window rules whose candidates each layer, side (and head) may take too, e.g.
            `frontier-2bit:rotary_center=True` beside `frontier-2bit`: keys centred where that pays. They are
            measured in the same passes (`measure`), and the choice is the one that tuning each alone on the same
            windows and allocating over the union of their candidates would make.

    Returns:
        the tuned pipeline (marked as tuned for `model`, `KVPipeline.tuned_for`) and a report: the choice per
        layer, measured bits, predicted KL, the sensitivity table, tokens, seconds and peak resident memory.
    """
    from torchkv.fitting.calibrate import token_windows

    started = time.perf_counter()
    resettable = reset_peak()
    pipe = check_tunable(pipe, model)
    also = [check_tunable(other, model) for other in also]
    check_budget(budget, *reachable(pipe, model, also))
    ids = token_windows(tokenizer, texts, seq_len, max_tokens)
    sensitivity = measure(pipe, model, ids, batch=batch, progress=progress, also=also)
    tuned, report = tuned_for_model(sensitivity, model, budget, per_head)
    tuned.tuned_on = domain
    report.update(seconds=time.perf_counter() - started, domain=domain, peak_rss_mib=peak_rss() / 2**20,
                  peak_rss_since="tune" if resettable else "process start")
    return tuned, report


def tuned_for_model(sensitivity: Sensitivity, model, budget: float, per_head: bool = False
                    ) -> tuple[KVPipeline, dict[str, Any]]:
    """`tuned_pipeline`, marked as tuned for `model`, with the measurement in its report (what `tune.json` holds)."""
    from torchkv.models.arch import fingerprint

    tuned, report = tuned_pipeline(sensitivity, budget, per_head, full_layers(model))
    tuned.tuned_for = fingerprint(model)
    report.update(
        preset=spelling(sensitivity.pipeline), also_presets=[spelling(p) for p in sensitivity.also],
        tokens=sensitivity.tokens, seq_len=sensitivity.seq_len,
        measure_seconds=sensitivity.seconds,
        sensitivity=[{side: dict(zip((c.label for c in sensitivity.candidates[i][side]), costs))
                      for side, costs in layer.items()} for i, layer in enumerate(sensitivity.costs)],
    )
    if per_head:
        report["head_sensitivity"] = [{side: {c.label: [float(x) for x in costs] for c, costs in
                                              zip(sensitivity.candidates[i][side], layer[side])} for side in layer}
                                      for i, layer in enumerate(sensitivity.head_costs)]
    return tuned, report


#: sensitivities measured on a calibration split, by model and by starting pipeline, token count and domain
_MEASURED: "weakref.WeakKeyDictionary[Any, dict[str, Sensitivity]]" = weakref.WeakKeyDictionary()


def calibration_sensitivity(pipe: KVPipeline, model, tokenizer, tokens: int = 32768, progress: bool = True,
                            domain: str = DEFAULT_DOMAIN) -> Sensitivity:
    """`measure` on `tokens` of `domain`'s calibration split (`torchkv.corpora`) in `SEQ_LEN`-token windows (one
    window of `tokens` where they are fewer), once per model, starting pipeline and domain (a sweep of budgets costs
    one measurement)."""
    from torchkv.corpora import split_articles
    from torchkv.fitting.calibrate import token_windows

    pipe = check_tunable(pipe, model)
    key = json.dumps([pipe.config(), tokens, domain], sort_keys=True, default=str)
    measured = _MEASURED.setdefault(model, {})
    if key not in measured:
        ids = token_windows(tokenizer, [text for _, text in split_articles("calibration", domain)], min(SEQ_LEN, tokens),
                            tokens)
        measured[key] = measure(pipe, model, ids, progress=progress)
    return measured[key]


def tuned_on_calibration_split(pipe: KVPipeline, model, tokenizer, budget: float, tokens: int = 32768,
                               progress: bool = True, domain: str = DEFAULT_DOMAIN) -> tuple[KVPipeline, dict[str, Any]]:
    """`tune` on `domain`'s calibration split, its sensitivities from `calibration_sensitivity`."""
    started = time.perf_counter()
    check_budget(budget, *reachable(check_tunable(pipe, model), model))
    sensitivity = calibration_sensitivity(pipe, model, tokenizer, tokens, progress, domain)
    tuned, report = tuned_for_model(sensitivity, model, budget)
    tuned.tuned_on = domain
    report.update(seconds=time.perf_counter() - started, domain=domain)
    return tuned, report
