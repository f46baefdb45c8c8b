"""Registries of transforms (by kind and name) and of presets (by name)."""

import difflib
import functools
import inspect
import types
import typing
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
        _PRESETS[name] = Preset(name, _checked_build(name, fn), description, nominal_bits, for_model)
        return fn

    return decorate


def _describe(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _fits(value: Any, annotation: Any) -> bool:
    """Whether an option value has its annotated type (bool is no int; an int is a float; a tuple annotation
    takes a list too, as JSON gives it back). Annotations this does not know accept anything."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return not args or (len(args) == len(value) and all(_fits(v, a) for v, a in zip(value, args)))
    return True


def _checked_build(name: str, fn: Callable) -> Callable:
    """`fn` (a preset's recipe) checking the overrides it is called with: a value of the wrong type, or one the
    recipe cannot build with, is a `ValueError` naming the preset, the option and what it takes."""
    try:
        parameters = inspect.signature(fn, eval_str=True).parameters
    except (NameError, TypeError):  # annotations that cannot be evaluated here: checked by the recipe alone
        parameters = inspect.signature(fn).parameters

    @functools.wraps(fn)
    def build(**overrides: Any) -> Any:
        for option, value in overrides.items():
            p = parameters.get(option)
            if p is not None and not _fits(value, p.annotation):
                raise ValueError(f"preset '{name}' option {option}={value!r} must be {_describe(p.annotation)} "
                                 f"(default {p.default!r})")
        if not overrides:
            return fn()
        given = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        try:
            return fn(**overrides)
        except ValueError as err:
            raise ValueError(f"preset '{name}' with {given}: {err}") from err
        except (TypeError, ArithmeticError, IndexError, KeyError) as err:  # a value out of the recipe's range
            defaults = ", ".join(f"{k}={parameters[k].default!r}" for k in overrides if k in parameters)
            raise ValueError(f"preset '{name}' cannot be built with {given} ({type(err).__name__}: {err}); "
                             f"its defaults: {defaults}") from err

    return build


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


#: functions of the layers above the pipeline that `KVPipeline`'s thin delegates call ("fit", "tune",
#: "for_model"), registered by the modules that define them, which `import torchkv` imports: the pipeline calls them
#: without importing anything above it
_DELEGATES: dict[str, Callable] = {}


def register_delegate(name: str) -> Callable[[Callable], Callable]:
    """Function decorator: `fn` serves `KVPipeline.{name}` (see `delegate`)."""

    def decorate(fn: Callable) -> Callable:
        _DELEGATES[name] = fn
        return fn

    return decorate


def delegate(name: str) -> Callable:
    """The function registered for `KVPipeline.{name}`."""
    if name not in _DELEGATES:
        raise RuntimeError(f"KVPipeline.{name} is served by a torchkv module that is not imported: `import torchkv`")
    return _DELEGATES[name]
