"""Reports of `torchkv eval` results: a Markdown table and plots (PNG, matplotlib)."""

import json
from pathlib import Path


def load(path: str | Path) -> dict:
    results = json.loads(Path(path).read_text())
    if "rows" not in results or "meta" not in results:
        raise ValueError(f"{path} is not a torchkv results file (no 'meta'/'rows')")
    return results


def _reference(results: dict) -> dict | None:
    return next((r for r in results["rows"] if r["name"] == results["meta"].get("reference")), None)


def longest(row: dict) -> dict | None:
    """The row's generation at its longest speed context, where the cache weighs most against the weights."""
    return max(row.get("generation") or [], key=lambda g: g["batch"] * g["context"], default=None)


def cache_bits(results: dict, row: dict) -> float | None:
    """Bits per cached value over the whole cache (windows and metadata included) at the longest speed context."""
    g, per_token = longest(row), results["meta"].get("values_per_token")
    if g is None or not per_token:
        return None
    tokens = g["batch"] * (g["context"] + g["new_tokens"] - 1)
    return 8 * g["cache_bytes"] / (tokens * per_token)


def _num(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def _encoded_bits(row: dict, key: str = "bits_per_value") -> float | None:
    bits = row.get(key)
    return None if not bits else (bits["keys"] + bits["values"]) / 2


def _encoded_cell(row: dict) -> str:
    """The mean over layers, and where the model has sliding-window layers, " / " the mean over its full layers."""
    full = _encoded_bits(row, "full_layer_bits_per_value")
    return _num(_encoded_bits(row)) + ("" if full is None else f" / {full:.2f}")


def _column(key: str, keys: list[str]) -> str:
    """A context key as a column label: "2048" is the default domain's, named once other domains are present."""
    return f"wiki/{key}" if "/" not in key and any("/" in k for k in keys) else key


def _row_label(row: dict) -> str:
    """The row's name, with the domains it was calibrated or tuned on (beside the evaluated ones in the header)."""
    config = row.get("config", {})
    fitted = [f"{what} on {config[key]}" for key, what in (("fitted_on", "calibrated"), ("tuned_on", "tuned"))
              if config.get(key)]
    return row["name"] + (f" ({', '.join(fitted)})" if fitted else "")


def _ppl_cell(row: dict, ref: dict | None, mode: str, ctx: str) -> str:
    value = row.get("ppl", {}).get(mode, {}).get(ctx)
    if value is None:
        return "–"
    base = (ref or {}).get("ppl", {}).get("streaming", {}).get(ctx)
    return f"{value:.3f}" if not base else f"{value:.3f} ({100 * (value / base - 1):+.2f}%)"


def _retrieval_cell(row: dict, ctx: str) -> str:
    r = row.get("retrieval", {}).get(ctx)
    return "–" if r is None else f"{r['accuracy']:.2f} / {r['logprob']:.2f}"


def _decode_cell(gen: dict | None, ref_gen: dict | None) -> str:
    if gen is None:
        return "–"
    ratio = f" ({gen['decode_tokens_per_s'] / ref_gen['decode_tokens_per_s']:.2f}x)" if ref_gen else ""
    return f"{gen['decode_tokens_per_s']:.1f}{ratio}"


def _short_generation_cell(gen: dict | None, ref_gen: dict | None) -> str:
    """End-to-end seconds of the timed generation, with its speed against the reference's (higher is faster)."""
    if gen is None or "generation_seconds" not in gen:
        return "–"
    ref_s = (ref_gen or {}).get("generation_seconds")
    return f"{gen['generation_seconds']:.2f}" + (f" ({ref_s / gen['generation_seconds']:.2f}x)" if ref_s else "")


def _domains_note(meta: dict, rows: list[dict]) -> str:
    """The evaluated text domains, each with what it is (results before domains existed name none), and the
    calibration domain of the run's own tuned rows (`tuned:ROW@BITS`) where it has any."""
    domains = meta.get("domains")
    if not domains:
        return ""
    named = "; ".join(f"{name}: {description}" for name, description in domains.items())
    tuned = any(row["name"].startswith("tuned:") for row in rows)
    return f" Held-out text by domain ({named})" + (
        f"; `tuned:ROW@BITS` rows are tuned on the calibration split of {meta['settings']['tune_domain']}."
        if tuned else ".")


def markdown_table(results: dict) -> str:
    """One line per row: quality, memory and speed, each beside the full-precision reference."""
    ref = _reference(results) or {}
    rows = results["rows"]
    modes = [m for m in ("streaming", "simulated") if any(m in row.get("ppl", {}) for row in rows)]
    ppl_cols = [(mode, ctx) for mode in modes for ctx in ref.get("ppl", {}).get("streaming", {})]
    ret_cols = list(ref.get("retrieval", {}))
    gen_ctx = [g["context"] for g in ref.get("generation", [])]
    header = ["row", "bits/value (cache)", "bits/value (encoded)"]
    ppl_keys = [ctx for _, ctx in ppl_cols]
    header += [f"ppl {_column(ctx, ppl_keys)} {mode}" for mode, ctx in ppl_cols]
    header += [f"retrieval {_column(c, ret_cols)} acc / logp" for c in ret_cols]
    steps = [g["new_tokens"] + g.get("warm_steps", 0) for g in ref.get("generation", [])[:1]]
    header += [f"cache MiB @{longest(ref)['context']}"] if gen_ctx else []
    header += [f"short generation @{c}: s for prompt + {n} tokens" for c, n in zip(gen_ctx, steps)]
    header += [f"steady-state decode tok/s @{c}" for c in gen_ctx] + [f"prefill tok/s @{c}" for c in gen_ctx[:1]]
    header += ["peak RSS growth MiB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ref_gens = {g["context"]: g for g in ref.get("generation", [])}
    for row in rows:
        gens = {g["context"]: g for g in row.get("generation", [])}
        first = gens.get(gen_ctx[0]) if gen_ctx else None
        cells = [_row_label(row), _num(cache_bits(results, row)), _encoded_cell(row)]
        cells += [_ppl_cell(row, ref, mode, ctx) for mode, ctx in ppl_cols]
        cells += [_retrieval_cell(row, c) for c in ret_cols]
        if gen_ctx:
            cells.append(_num(longest(row) and longest(row)["cache_bytes"] / 2**20, ".1f"))
            cells.append(_short_generation_cell(first, ref_gens.get(gen_ctx[0])))
        cells += [_decode_cell(gens.get(c), ref_gens.get(c)) for c in gen_ctx]
        if gen_ctx:
            cells.append(_num(first and first["prefill_tokens_per_s"], ".0f"))
        growth = first and first.get("peak_over_start_bytes")
        cells.append(_num(growth and growth / 2**20, ".0f"))
        lines.append("| " + " | ".join(cells) + " |")
    meta = results["meta"]
    prompt = meta["settings"].get("ppl_prompt", 0.0)
    first = f"the first {prompt:g} of each document as one prompt, then " if prompt else ""
    scored = " (only tokens after the prompt are scored)" if prompt else ""
    lines += [
        "",
        f"{meta['model']} ({meta['dtype']}), torch {meta['torch']}, transformers {meta['transformers']}, "
        f"{meta['machine']['cpu']} ({meta['machine']['cpu_count']} cores). ppl streaming: {first}blocks of "
        f"{meta['settings']['block']} tokens read the compressed history{scored}; simulated: every token is read "
        "compressed (no full-precision window, no sinks). Increases are against the full-precision DynamicCache "
        "row. bits/value (cache): all cache bytes (windows, metadata) per cached value at the longest speed context; "
        "(encoded): stored bits per compressed value (metadata included) of one encoded chunk, the mean over layers"
        + (", then over the layers without a sliding window: a cache's bits per value are the first up to the "
           "window and tend to the second past it" if any(r.get("full_layer_bits_per_value") for r in rows) else "")
        + ". Speed, batch 1, graphs already "
        "compiled: a short generation is the prefill and every decode step of one answer, end to end (ratio: "
        "DynamicCache's time over the row's); "
        f"steady-state decode times {meta['settings']['new_tokens']} steps after untimed warm-up "
        "steps (ratio: tokens/s over DynamicCache's). Where the cache's work dominates a step (long contexts, "
        "large batches), the steady state shows what compression buys." + _domains_note(meta, rows),
    ]
    if pareto_points(results):
        lines += ["", "Pareto (plotted in `<results>_pareto.png`): a row is on a frontier when no row with as few bits "
                  "or fewer beats it there; the last column lists rows ahead of it on quality and speed at once "
                  "with as few bits or fewer.", "", pareto_table(results)]
    return "\n".join(lines)


def pareto_points(results: dict) -> list[dict]:
    """Every compressed row as a point: cache bits per value, perplexity increase (streaming, first context) and
    decode speed as a ratio to the reference (steady state at the longest speed context); `quality_frontier` /
    `speed_frontier`: no other row has as few bits or fewer and a lower increase (a higher speed); `dominated_by`:
    rows with as few bits or fewer that are ahead on quality and speed at once."""
    ref = _reference(results)
    if not ref or not ref.get("ppl", {}).get("streaming") or not ref.get("generation"):
        return []
    ctx = next(iter(ref["ppl"]["streaming"]))
    ref_speed = longest(ref)["decode_tokens_per_s"]
    points = []
    for row in results["rows"]:
        bits, value = cache_bits(results, row), row.get("ppl", {}).get("streaming", {}).get(ctx)
        if row is ref or bits is None or value is None:
            continue
        increase = 100 * (value / ref["ppl"]["streaming"][ctx] - 1)
        points.append({"name": row["name"], "bits": bits, "ppl_increase": increase,
                       "decode_ratio": longest(row)["decode_tokens_per_s"] / ref_speed})
    for p in points:
        fewer = [o for o in points if o is not p and o["bits"] <= p["bits"]]
        p["quality_frontier"] = all(o["ppl_increase"] >= p["ppl_increase"] for o in fewer)
        p["speed_frontier"] = all(o["decode_ratio"] <= p["decode_ratio"] for o in fewer)
        p["dominated_by"] = [o["name"] for o in fewer
                             if o["ppl_increase"] < p["ppl_increase"] and o["decode_ratio"] > p["decode_ratio"]]
    return points


def pareto_table(results: dict) -> str:
    """`pareto_points` as Markdown, fewest bits first."""
    points = sorted(pareto_points(results), key=lambda p: p["bits"])
    ref = _reference(results)
    keys = list(ref["ppl"]["streaming"])
    lines = [f"| row | cache bits/value | ppl increase % ({_column(keys[0], keys)}) | steady-state decode vs "
             f"DynamicCache @{longest(ref)['context']} | quality frontier | speed frontier | "
             "ahead on both at ≤ bits |",
             "|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['name']} | {p['bits']:.2f} | {p['ppl_increase']:+.2f} | {p['decode_ratio']:.2f}x | "
                     f"{'yes' if p['quality_frontier'] else ''} | {'yes' if p['speed_frontier'] else ''} | "
                     f"{', '.join(p['dominated_by']) or '–'} |")
    return "\n".join(lines)


def tuned_curves(points: list[tuple[str, float, float]]) -> dict[str, list[tuple[float, float]]]:
    """(name, bits, value) points of tuned rows (`tuned:ROW@BITS`) as one curve per starting row, by bits."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for name, bits, value in points:
        if name.startswith("tuned:"):
            curves.setdefault(name.removeprefix("tuned:").rpartition("@")[0], []).append((bits, value))
    return {start: sorted(line) for start, line in curves.items()}


def _draw_tuned(ax, points: list[tuple[str, float, float]]) -> None:
    for start, line in tuned_curves(points).items():
        ax.plot(*zip(*line), marker=".", linewidth=1.2, alpha=0.8, label=f"tuned {start} (budget sweep)")


def _pareto_plot(results: dict, out_dir: Path, stem: str, plt) -> Path | None:
    """Two panels against cache bits per value: perplexity increase, and decode speed; frontiers drawn."""
    points = pareto_points(results)
    if not points:
        return None
    meta, ref = results["meta"], _reference(results)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, frontier, label in (
        (axes[0], "ppl_increase", "quality_frontier", f"perplexity increase, % ({next(iter(ref['ppl']['streaming']))}"
                                                      "-token documents, streaming)"),
        (axes[1], "decode_ratio", "speed_frontier", f"decode speed / DynamicCache ({longest(ref)['context']} "
                                                    "tokens, batch 1)"),
    ):
        for p in points:
            on = p[frontier]
            ax.scatter(p["bits"], p[key], s=60 if on else 30, marker="D" if p["name"].startswith("frontier") else "o",
                       color="tab:red" if on else "tab:gray", zorder=3)
            ax.annotate(p["name"], (p["bits"], p[key]), textcoords="offset points", xytext=(4, 3), fontsize=7)
        line = sorted((p["bits"], p[key]) for p in points if p[frontier])
        ax.step(*zip(*line), where="post", color="tab:red", alpha=0.6, label="frontier")
        _draw_tuned(ax, [(p["name"], p["bits"], p[key]) for p in points])
        ax.set_xlabel("measured cache bits per value (windows and metadata included)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("symlog", linthresh=1.0)
    fig.suptitle(f"Quality, memory and speed — {meta['model']} ({meta['machine']['cpu_count']} CPU cores), one run")
    fig.tight_layout()
    path = out_dir / f"{stem}_pareto.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ppl_plot(results: dict, ref: dict, out_dir: Path, stem: str, plt) -> Path:
    """Perplexity increase (streaming, the first context) against measured bits per value: `<stem>_ppl_vs_bits.png`."""
    import matplotlib.ticker

    ctx = next(iter(ref["ppl"]["streaming"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = []
    for row in results["rows"]:
        bits, value = cache_bits(results, row), row.get("ppl", {}).get("streaming", {}).get(ctx)
        if row is ref or bits is None or value is None:
            continue
        increase = max(100 * (value / ref["ppl"]["streaming"][ctx] - 1), 1e-3)
        drawn.append((row["name"], bits, increase))
        marker = "s" if row["kind"] == "quanto" else "o"
        ax.scatter(bits, increase, marker=marker, s=50)
        ax.annotate(row["name"], (bits, increase), textcoords="offset points", xytext=(5, 4), fontsize=8)
    _draw_tuned(ax, drawn)
    if tuned_curves(drawn):
        ax.legend(fontsize=7)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("measured bits per cached value (metadata and windows included)")
    ax.set_ylabel("perplexity increase, %")
    ax.set_title(f"Quality vs memory — {results['meta']['model']}, {ctx}-token documents, streaming")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = out_dir / f"{stem}_ppl_vs_bits.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plots(results: dict, out_dir: str | Path, stem: str) -> list[Path]:
    """`<stem>_ppl_vs_bits.png`, `<stem>_decode_speed.png` (tokens/s against context) and `<stem>_pareto.png`: named
    after the results file, so that runs written to one folder keep their own plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ref = _reference(results)
    written = []
    if ref and ref.get("ppl", {}).get("streaming"):
        written.append(_ppl_plot(results, ref, out_dir, stem, plt))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drew = False
    for row in results["rows"]:
        points = sorted((g["context"], g["decode_tokens_per_s"]) for g in row.get("generation", []))
        if points:
            ax.plot(*zip(*points), marker="o", label=row["name"], linestyle="--" if row["kind"] != "torchkv" else "-")
            drew = True
    if drew:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("decode tokens/s (batch 1)")
        ax.set_title(f"Decode speed — {results['meta']['model']}, {results['meta']['machine']['cpu_count']} CPU cores")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}_decode_speed.png"
        fig.savefig(path, dpi=120)
        written.append(path)
    plt.close(fig)
    pareto = _pareto_plot(results, out_dir, stem, plt)
    return written + ([pareto] if pareto else [])
