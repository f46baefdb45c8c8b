"""Reports of `benchmarks/decode.py` results: Markdown tables and a plot of decode speed against DynamicCache."""

from pathlib import Path

from torchkv.eval.rows import STATIC_BASELINE


def _cells(results: dict) -> list[tuple[str, int, int]]:
    """(dtype, batch, context) of every measured cell, by dtype (as first measured), batch and context."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in results["rows"]))
    cells = {(r["dtype"], r["batch"], r["context"]) for r in results["rows"]}
    return sorted(cells, key=lambda c: (dtypes.index(c[0]), c[1], c[2]))


def _by_cell(results: dict) -> dict[tuple[str, int, int, str], dict]:
    return {(r["dtype"], r["batch"], r["context"], r["name"]): r for r in results["rows"]}


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(c) + " |" for c in lines]


def _peak(row: dict) -> float | None:
    """Peak memory of the timed run in MiB: the CUDA allocator's peak on a GPU, RSS growth over start on a CPU."""
    peak = row.get("cuda_peak_bytes", row.get("peak_over_start_bytes"))
    return None if peak is None else peak / 2**20


def markdown_table(results: dict) -> str:
    """Decode tokens/s (x DynamicCache), prefill ratio, cache and peak memory per cell; the kernel rows."""
    cells = _cells(results)
    rows = _by_cell(results)
    names = list(dict.fromkeys(r["name"] for r in results["rows"]))
    labels = [f"{d} b{b} {c}" for d, b, c in cells]

    def line(name, fmt):
        return [name] + [fmt(rows.get((*cell, name))) for cell in cells]

    def decode(r):
        return "–" if r is None else f"{r['decode_tokens_per_s']:.1f} ({r['decode_ratio']:.2f}x)"

    def prefill(r):
        return "–" if r is None else f"{r['prefill_tokens_per_s']:.0f} ({r['prefill_ratio']:.2f}x)"

    def memory(r):
        peak = None if r is None else _peak(r)
        return "–" if r is None else f"{r['cache_bytes'] / 2**20:.0f} / {'–' if peak is None else f'{peak:.0f}'}"

    meta = results["meta"]
    machine = meta["machine"]
    device = machine.get("gpu") if meta.get("device", "cpu").startswith("cuda") else f"{machine['cpu']} ({machine['cpu_count']} cores)"
    peak_kind = "CUDA allocator peak" if meta.get("device", "cpu").startswith("cuda") else "RSS growth over the run's start"
    out = [f"Decode benchmark, {meta['model']}, torch {meta['torch']}, {device}; {meta['new_tokens']} timed decode tokens.", ""]
    if not names:  # a run of kernel rows alone (`--baselines '' --presets '' --compiled-presets ''`)
        return "\n".join(out + _kernel_table(results))
    out += ["Decode tokens/s (ratio to DynamicCache of the same cell):", ""]
    out += _table(["row"] + labels, [line(n, decode) for n in names])
    static = STATIC_BASELINE
    if static in names:
        def to_static(name):
            def ratio(r):
                ref = None if r is None else rows.get((r["dtype"], r["batch"], r["context"], static))
                return "–" if ref is None else f"{r['decode_tokens_per_s'] / ref['decode_tokens_per_s']:.2f}x"
            return line(name, ratio)

        out += ["", "Decode speed as a ratio to transformers' StaticCache with the whole step compiled:", ""]
        out += _table(["row"] + labels, [to_static(n) for n in names])
    out += ["", "Prefill tokens/s (ratio to DynamicCache):", ""]
    out += _table(["row"] + labels, [line(n, prefill) for n in names])
    out += ["", f"Cache MiB / peak MiB ({peak_kind}) of the timed generation:", ""]
    out += _table(["row"] + labels, [line(n, memory) for n in names])
    return "\n".join(out + _kernel_table(results))


def _kernel_table(results: dict) -> list[str]:
    """The kernel rows' table (none: no lines)."""
    out = []
    if results.get("kernel"):
        bandwidths = [run["copy_bandwidth_bytes_per_s"] for run in results["meta"]["runs"]]
        out += ["", "One layer's decode attention (3 KV heads x 3 query heads, head_dim 64): torchkv over packed codes vs "
                f"DynamicCache concat + SDPA over fp32; measured copy bandwidth {min(bandwidths) / 1e9:.1f}–"
                f"{max(bandwidths) / 1e9:.1f} GB/s.", ""]
        out += _table(
            ["preset", "context", "batch", "layer", "torchkv ms", "SDPA ms", "speedup", "compressed MiB", "GB/s",
             "of copy bw"],
            [[k["preset"], str(k["context"]), str(k["batch"]), str(k.get("layer", 0)), f"{k['torchkv_ms']:.3f}",
              f"{k['dynamic_ms']:.3f}",
              f"{k['speedup']:.2f}x", f"{k['compressed_bytes'] / 2**20:.2f}", f"{k['achieved_bytes_per_s'] / 1e9:.2f}",
              f"{100 * k['fraction_of_copy_bandwidth']:.2f}%"] for k in results["kernel"]],
        )
    return out


def plots(results: dict, out_dir: str | Path, stem: str = "decode") -> list[Path]:
    """Decode speed as a ratio to DynamicCache against context, one panel per (dtype, batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((d, b) for d, b, _ in _cells(results)))
    if not panels:  # kernel rows alone: nothing to plot against context
        return []
    names = list(dict.fromkeys(r["name"] for r in results["rows"]))
    colors = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (dtype, batch) in zip(axes[0], panels):
        rows = [r for r in results["rows"] if r["dtype"] == dtype and r["batch"] == batch]
        for i, name in enumerate(names):
            points = sorted((r["context"], r["decode_ratio"]) for r in rows if r["name"] == name)
            if points:
                style = "--" if name == "dynamic" or name.startswith("quanto") else "-"
                ax.plot(*zip(*points), marker="o", linestyle=style, color=colors(i % 20), label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        contexts = sorted({r["context"] for r in rows})
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s / DynamicCache")
        ax.set_title(f"{dtype}, batch {batch}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Decode speed vs DynamicCache — {results['meta']['model']} on {results['meta'].get('device', 'cpu')}")
    fig.tight_layout()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
