"""Registries of transforms (by kind and name) and of presets (by name)."""

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KINDS = ("rotate", "project", "predict", "quantize", "pack")

_TRANSFORMS: dict[tuple[str, str], type] = {}
_PRESETS: dict[str, "Preset"] = {}


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def register_transform(kind: str, name: str) -> Callable[[type], type]:
    """Class decorator: register a transform under `(kind, name)`.

    Usage: `@register_transform("quantize", "my_q") class MyQuantize(Transform): ...`
    """
    if kind not in KINDS:
        raise ValueError(f"unknown transform kind '{kind}'; allowed: {', '.join(KINDS)}")

    def decorate(cls: type) -> type:
        if (kind, name) in _TRANSFORMS:
            raise ValueError(f"transform ('{kind}', '{name}') is already registered by {_TRANSFORMS[kind, name]}")
        cls.kind, cls.name = kind, name
        _TRANSFORMS[kind, name] = cls
        return cls

    return decorate


def transform_class(kind: str, name: str) -> type:
    """The class registered under `(kind, name)`; a clear error lists the names of that kind."""
    if kind not in KINDS:
        raise ValueError(f"unknown transform kind '{kind}'; allowed: {', '.join(KINDS)}")
    if (kind, name) not in _TRANSFORMS:
        names = sorted(n for k, n in _TRANSFORMS if k == kind)
        raise ValueError(
            f"unknown {kind} transform '{name}'{_suggest(name, names)}; registered: {', '.join(names)}"
        )
    return _TRANSFORMS[kind, name]


def transforms() -> list[tuple[str, str]]:
    """All registered `(kind, name)` pairs."""
    return sorted(_TRANSFORMS)


@dataclass(frozen=True)
class Preset:
    """A named pipeline recipe: `build(**overrides)` returns a `KVPipeline`.

    `for_model(text_config) -> {option: value}` gives the options the recipe derives from a model's shapes,
    used for those left "auto" (`KVPipeline.for_model`)."""

    name: str
    build: Callable[..., Any]
    description: str
    nominal_bits: float
    for_model: Callable[[Any], dict[str, Any]] | None = None

    def options(self) -> dict[str, Any]:
        """Overridable parameters and their defaults."""
        return {p.name: p.default for p in inspect.signature(self.build).parameters.values()}


def register_preset(
    name: str, *, description: str, nominal_bits: float, for_model: Callable[[Any], dict[str, Any]] | None = None
) -> Callable:
    """Function decorator: register a preset whose keyword parameters are its overridable options.

    Usage:
        @register_preset("kivi-2bit", description="KIVI, 2-bit", nominal_bits=2.0)
        def kivi_2bit(residual: int = 128, group: int = 32) -> KVPipeline: ...
    """

    def decorate(fn: Callable) -> Callable:
        if name in _PRESETS:
            raise ValueError(f"preset '{name}' is already registered")
        _PRESETS[name] = Preset(name, fn, description, nominal_bits, for_model)
        return fn

    return decorate


def preset(name: str) -> Preset:
    """The preset called `name`; unknown names get the list of presets and the closest match."""
    if name not in _PRESETS:
        names = sorted(_PRESETS)
        raise ValueError(
            f"unknown preset '{name}'{_suggest(name, names)}; available: {', '.join(names)} "
            "(see torchkv.presets())"
        )
    return _PRESETS[name]


def preset_names() -> list[str]:
    return sorted(_PRESETS)
