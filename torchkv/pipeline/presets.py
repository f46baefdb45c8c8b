"""Presets by name: the `name[:key=value...]` spelling, building one with overrides, and the list of them.

The registry is filled by `torchkv.methods`, which `import torchkv` imports (one file per method registers its
presets), so this module reads it and imports no method."""

import ast
from typing import Any

from torchkv import registry

DEFAULT_PRESET = "kivi-4bit"


def parse_preset(text: str) -> tuple[str, dict[str, Any]]:
    """`name[:key=value...]` -> (preset name, overrides), e.g. "kivi-2bit:residual=32:group=64". Values are Python
    literals (numbers, booleans, tuples, quoted strings), or else taken as strings. The one spelling of a preset
    with overrides: `torchkv.patch`, `KVPipeline.from_preset`, `torchkv eval`/`generate` and the benchmarks."""
    name, *options = text.split(":")
    overrides: dict[str, Any] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"preset option {option!r} in {text!r} must be written key=value, "
                             "e.g. kivi-2bit:residual=32")
        if key in overrides:
            raise ValueError(f"preset option {key!r} is given twice in {text!r}")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value
    return name, overrides


def spelling(pipe) -> str:
    """How to build `pipe` again by name: its preset's name with the options that differ from the preset's defaults
    after colons (`parse_preset` reads it back, e.g. "frontier-2bit:rotary_center=True"); a pipeline built from
    no preset: its name."""
    if pipe.name not in registry.preset_names():
        return pipe.name
    defaults = registry.preset(pipe.name).options()
    changed = [f"{key}={value!r}" for key, value in pipe.options.items() if key in defaults and defaults[key] != value]
    return ":".join([pipe.name, *changed])


def from_preset(name: str, *, compile: bool | str = "auto", **overrides: Any):
    """The preset `name` (see `torchkv.presets()`), with overrides of its options after colons in `name`
    (`parse_preset`: "kivi-2bit:residual=32") and as keywords.

    `compile` as in `KVPipeline`; False also reads no packed codes in decode attention (rebuilt history)."""
    name, written = parse_preset(name)
    twice = sorted(set(written) & set(overrides))
    if twice:
        raise ValueError(f"preset '{name}' option(s) {twice} given both after a colon and as keywords")
    overrides = {**written, **overrides}
    preset = registry.preset(name)
    options = preset.options()
    unknown = sorted(set(overrides) - set(options))
    if unknown:
        raise ValueError(f"preset '{name}' has no option(s) {unknown}; valid options: {sorted(options)}")
    pipe = preset.build(**overrides)
    pipe.name, pipe.options, pipe.compile = name, {**options, **overrides}, compile
    return pipe


def presets() -> list[dict[str, Any]]:
    """Every registered preset: name, one-line description, nominal bits per value, options, and whether it
    must be calibrated (`KVPipeline.fit`, `torchkv calibrate`) before use."""
    return [
        {
            "name": p.name,
            "description": p.description,
            "nominal_bits": p.nominal_bits,
            "options": p.options(),
            "calibrate": p.build().needs_fit,
        }
        for p in map(registry.preset, registry.preset_names())
    ]
