"""Reports of long-context results (`torchkv.eval.long_context`): Markdown tables and PNG plots (matplotlib)."""

import json
import math
import textwrap
from pathlib import Path

SUITE, NEEDLE = "long-suite", "needle"
KINDS = (SUITE, NEEDLE)


def load(path: str | Path) -> dict:
    """A results file; cells written before domains existed are the default domain's (wiki)."""
    results = json.loads(Path(path).read_text())
    if results.get("meta", {}).get("kind") not in KINDS or "cells" not in results:
        raise ValueError(f"{path} is not a long-context results file (meta.kind one of {KINDS}, and 'cells')")
    for cell in results["cells"]:
        cell.setdefault("domain", "wiki")
    return results


def by_domain(results: dict) -> dict[str, dict]:
    """The results split by the domain of their haystacks, each with its own cells, in the order they ran."""
    domains = dict.fromkeys(c.get("domain", "wiki") for c in results["cells"])
    return {d: {**results, "cells": [c for c in results["cells"] if c.get("domain", "wiki") == d]} for d in domains}


def _presets(results: dict) -> list[str]:
    return list(dict.fromkeys(c["preset"] for c in results["cells"]))


def _sorted(results: dict, field: str) -> list:
    return sorted({c[field] for c in results["cells"]})


def _run(cells: list[dict]) -> list[dict]:
    return [c for c in cells if "skipped" not in c]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _skips(results: dict) -> list[str]:
    return list(dict.fromkeys(c["skipped"] for c in results["cells"] if "skipped" in c))


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(c) + " |" for c in lines]


def _cell(value: float | None, spec: str = ".2f") -> str:
    return "skip" if value is None else format(value, spec)


def _suite_table(results: dict) -> list[str]:
    tasks, lengths = list(dict.fromkeys(c["task"] for c in results["cells"])), _sorted(results, "length")
    header = ["preset"] + [f"{label} {n}" for n in lengths for label in (*tasks, "mean")]
    lines = []
    for preset in _presets(results):
        cells = {(c["task"], c["length"]): c for c in results["cells"] if c["preset"] == preset}
        line = [preset]
        for n in lengths:
            at = [cells.get((t, n)) for t in tasks]
            line += ["–" if c is None else _cell(c.get("accuracy")) for c in at]  # – : not in this file
            line.append(_cell(_mean([c["accuracy"] for c in _run([c for c in at if c is not None])])))
        lines.append(line)
    return _table(header, lines)


def _needle_table(results: dict) -> list[str]:
    lengths = _sorted(results, "length")
    header = ["preset"] + [str(n) for n in lengths] + ["mean", "mean logprob"]
    lines = []
    for preset in _presets(results):
        cells = _run([c for c in results["cells"] if c["preset"] == preset])
        line = [preset] + [_cell(_mean([c["accuracy"] for c in cells if c["length"] == n])) for n in lengths]
        line += [_cell(_mean([c["accuracy"] for c in cells])), _cell(_mean([c["logprob"] for c in cells]))]
        lines.append(line)
    return _table(header, lines)


def markdown_table(results: dict) -> str:
    """Suite: accuracy per task and length (and its mean per length) per preset; needle: accuracy per length
    (mean over depths) per preset, with the mean answer log-probability."""
    meta = results["meta"]
    samples = meta["settings"]["samples"]
    if meta["kind"] == SUITE:
        out = [(f"Long-context suite, {meta['model']}, {samples} seeded samples per cell. Accuracy: mean recall of the "
               f"answers in the greedy generation through each cache (up to {meta['settings']['max_new_tokens']} new "
               "tokens, cut at a newline)."), ""]
        table = _suite_table
    else:
        out = [(f"Needle in a haystack, {meta['model']}, {samples} seeded samples per length x depth. Accuracy: "
               "fraction of needles greedy decoding would reproduce, mean over depths; logprob: mean answer "
               "log-probability (nats), read through each cache."), ""]
        table = _needle_table
    parts = by_domain(results)
    for i, (name, part) in enumerate(parts.items()):
        if len(parts) > 1:
            out += ([""] if i else []) + [f"Haystacks from the '{name}' domain's held-out text:", ""]
        out += table(part)
    skips = _skips(results)
    if skips:
        out += ["", "Skipped: " + "; ".join(skips) + "."]
    return "\n".join(out)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _note_skips(fig, results: dict, y: float) -> None:
    skips = _skips(results)
    if skips:
        fig.text(0.01, y, "grey hatched: skipped (" + "; ".join(skips) + ")", fontsize=8, color="dimgrey", va="top")


def _suite_plot(results: dict, out_dir: Path, stem: str) -> Path:
    """Accuracy against context length, one line per preset: the mean over tasks, then one panel per task."""
    plt = _pyplot()
    tasks = list(dict.fromkeys(c["task"] for c in results["cells"]))
    panels = [None] + (tasks if len(tasks) > 1 else [])
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows + 0.4), squeeze=False)
    colors = plt.get_cmap("tab10")
    lengths = _sorted(results, "length")
    skipped = sorted({c["length"] for c in results["cells"] if "skipped" in c})
    for ax, task in zip(axes.flat, panels):
        presets = _presets(results)
        for i, preset in enumerate(presets):
            cells = [c for c in _run(results["cells"]) if c["preset"] == preset and task in (None, c["task"])]
            dodge = 2 ** (0.05 * (i - (len(presets) - 1) / 2))  # presets with equal accuracies stay visible
            points = [(n * dodge, _mean([c["accuracy"] for c in cells if c["length"] == n])) for n in lengths]
            points = [(n, a) for n, a in points if a is not None]
            if points:
                style = "--" if preset == results["meta"]["reference"] else "-"
                ax.plot(*zip(*points), marker="os^Dv"[i % 5], linestyle=style, color=colors(i % 10), label=preset)
        for n in skipped:
            ax.axvspan(n / 2**0.3, n * 2**0.3, facecolor="lightgrey", hatch="//", edgecolor="grey", alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy")
        ax.set_title("mean over tasks" if task is None else task)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"Accuracy vs context length — {results['meta']['model']}")
    _note_skips(fig, results, 0.025)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _heatmaps(results: dict, field: str, label: str, spec: str, path: Path) -> Path:
    """One heatmap per preset, side by side: x context length, y needle depth, colour `field` (red low, green
    high), each cell annotated; skipped cells grey and hatched."""
    plt = _pyplot()
    from matplotlib.patches import Rectangle

    presets, lengths, depths = _presets(results), _sorted(results, "length"), _sorted(results, "depth")
    values = [c[field] for c in _run(results["cells"])]
    low, high = (0.0, 1.0) if field == "accuracy" else (min(values, default=-1.0), max(values, default=0.0))
    if high <= low:
        low, high = low - 1.0, high + 1.0
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")
    fig, axes = plt.subplots(1, len(presets), figsize=(0.9 * len(lengths) * len(presets) + 2.5, 0.45 * len(depths) + 2),
                             squeeze=False, layout="constrained")
    image = None
    for ax, preset in zip(axes[0], presets):
        at = {(c["length"], c["depth"]): c for c in results["cells"] if c["preset"] == preset}
        grid = [[at[(n, d)].get(field, math.nan) if (n, d) in at else math.nan for n in lengths] for d in depths]
        image = ax.imshow(grid, cmap=cmap, vmin=low, vmax=high, aspect="auto")
        for y, d in enumerate(depths):
            for x, n in enumerate(lengths):
                cell = at.get((n, d))
                if cell is None or "skipped" in cell:
                    ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, hatch="//", edgecolor="grey"))
                    ax.text(x, y, "–" if cell is None else "skip", ha="center", va="center", fontsize=7)
                else:
                    ax.text(x, y, format(cell[field], spec), ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths] if ax is axes[0, 0] else [])
        ax.set_title(textwrap.fill(Path(preset).name, 18), fontsize=8)  # a saved folder by its own name
    axes[0, 0].set_ylabel("needle depth")
    fig.supxlabel("context length (tokens)")
    fig.colorbar(image, ax=axes[0].tolist(), label=label, fraction=0.03)
    fig.suptitle(f"Needle in a haystack: {label} — {results['meta']['model']}")
    _note_skips(fig, results, -0.05)  # below the x labels; the tight bounding box takes it in
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plots(results: dict, out_dir: str | Path, stem: str) -> list[Path]:
    """Suite: `<stem>.png`, accuracy against context length. Needle: `<stem>_accuracy.png` and
    `<stem>_logprob.png`, heatmaps of depth x length per preset. With several domains, `<stem>_<domain>...` each."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = by_domain(results)
    written = []
    for name, part in parts.items():
        named = stem if len(parts) == 1 else f"{stem}_{name}"  # one set of plots per domain
        if results["meta"]["kind"] == SUITE:
            written.append(_suite_plot(part, out_dir, named))
            continue
        written += [_heatmaps(part, "accuracy", "accuracy (greedy answer)", ".2f", out_dir / f"{named}_accuracy.png"),
                    _heatmaps(part, "logprob", "answer log-probability (nats)", ".1f",
                              out_dir / f"{named}_logprob.png")]
    return written
