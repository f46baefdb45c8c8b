"""A pipeline described for people: `explain` (how decode attention reads each layer's history) and `describe`
(its `repr`)."""

from torchkv.pipeline.head_groups import HeadGroups


def explain(pipeline, num_layers: int | None = None) -> str:
    """How compiled decode attention reads each layer's history, one line per group of layers read alike:
    keys scored and values summed from the stored form, or rebuilt every step (and why)."""
    def reading(pipe) -> str:
        parts = []
        sides = (("keys", pipe.keys, "scores", "scored"), ("values", pipe.values, "sums", "summed"))
        for side, chain, use, verb in sides:
            why = chain.rebuilds[use]
            if not pipeline.compile:
                why = "compile=False runs decode attention eagerly over rebuilt tokens"
            elif pipeline.selector is not None:
                why = "sparse attention gathers the chunks it selects and rebuilds them"
            elif pipeline.carries and side == "keys" and why is None:
                why = "the pipeline predicts across layers, and the next layer reads this one's rebuilt keys"
            parts.append(f"{side} {verb} from the stored form" if why is None else f"{side} rebuilt: {why}")
        kernel, refusal = pipe.codec.kernel()
        kernels = {"kivi": "the Triton kernel over KIVI's layout", "grid": "the Triton kernel over grid-coded keys"}
        parts.append(f"on CUDA {' and '.join(kernels[k] for k in kernel.split('+'))}" if kernel
                     else f"on CUDA no GPU kernel ({refusal}), Inductor's reductions")
        if isinstance(pipe.keys, HeadGroups):
            parts.append(f"KV heads in {len(pipe.keys.heads)} groups by (key, value) pair, each read as that pair alone")
        if any(getattr(t.config, "query_metric", False) for t in pipe.keys.transforms):
            parts.append("keys encoded by Inductor, not the fused Triton encoder (codes chosen under the queries' "
                         "metric)")
        return "; ".join(parts)

    last = num_layers or max(pipeline.layer_chains, default=-1) + 2
    lines: list[tuple[int, int | None, str]] = []
    for layer in range(last):
        text = reading(pipeline.for_layer(layer))
        if lines and lines[-1][2] == text:
            lines[-1] = (lines[-1][0], layer, text)
        else:
            lines.append((layer, layer, text))
    if num_layers is None:
        lines[-1] = (lines[-1][0], None, lines[-1][2])  # the main chains serve every later layer
    if len(lines) == 1:
        return f"every layer: {lines[0][2]}"
    return "\n".join(f"layer {a}: {t}" if a == b else f"layers {a}-{'' if b is None else b}: {t}"
                     for a, b, t in lines)


def describe(pipeline) -> str:
    """The pipeline's `repr`: window rules, both chains, and each group of layers with chains of their own."""
    groups: dict[int, list[int]] = {}
    for layer, (keys, _) in pipeline.layer_chains.items():
        groups.setdefault(id(keys), []).append(layer)
    return (
        f"KVPipeline(name={pipeline.name!r}, residual={pipeline.residual}, sinks={pipeline.sinks}, "
        f"chunk={pipeline.chunk}, "
        f"window={pipeline.window},\n"
        f"  keys={pipeline.keys!r},\n  values={pipeline.values!r}"
        + "".join(f",\n  layers {ranges(layers)}: keys={pipeline.layer_chains[layers[0]][0]!r}, "
                  f"values={pipeline.layer_chains[layers[0]][1]!r}" for layers in groups.values())
        + ")"
    )


def ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
