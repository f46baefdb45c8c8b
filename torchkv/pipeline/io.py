"""A pipeline on disk: `torchkv_config.json` (chains, window rules, what it was fitted for) and
`torchkv_params.safetensors` (fitted parameters, a shared tensor written once), with the migration of older folders.

The functions take the pipeline class as an argument (`KVPipeline.from_pretrained` passes itself), so this module
imports nothing above it."""

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from torchkv import window as windows
from torchkv.pipeline.head_groups import HeadGroups
from torchkv.pipeline.state import prefixed, substate
from torchkv.transforms import build

CONFIG_FILE = "torchkv_config.json"
PARAMS_FILE = "torchkv_params.safetensors"
FORMAT_VERSION = 1


def config(pipe) -> dict[str, Any]:
    """The JSON configuration `save_pretrained` writes."""
    return {
        "format": "torchkv.KVPipeline",
        "version": FORMAT_VERSION,
        "name": pipe.name,
        "options": pipe.options,
        "residual": pipe.residual,
        "sinks": pipe.sinks,
        "chunk": pipe.chunk,
        "window": None if pipe.window is None else pipe.window.spec(),
        "keys": pipe.keys.spec(),
        "values": pipe.values.spec(),
        "layers": {str(layer): {"keys": k.spec(), "values": v.spec()} for layer, (k, v) in pipe.layer_chains.items()},
        "fitted_for": pipe.fitted_for,
        "tuned_for": pipe.tuned_for,
        # the text domains of fit and tune, where known: absent otherwise, as in folders saved before they existed
        **{key: domain for key, domain in (("fitted_on", pipe.fitted_on), ("tuned_on", pipe.tuned_on)) if domain},
    }


def params(pipe) -> dict[str, torch.Tensor]:
    """Calibrated parameters of every transform (what `save_pretrained` writes), keyed "k.{i}.{name}" /
    "v.{i}.{name}" ("layer{n}." before those of the chains layer n is the first to have, `layers`). Parameters a
    transform derives from the model's weights are left out: `for_model` derives them again."""
    out = {}
    for prefix, chain in pipe.chains():
        for i, t in enumerate(chain.transforms):
            if not t.fits_weights:
                out.update(prefixed(t.params, f"{prefix}{i}."))
    return out


def load_params(pipe, params: Mapping[str, torch.Tensor]) -> None:
    """Set the transforms' parameters from `params()`'s output."""
    for prefix, chain in pipe.chains():
        for i, t in enumerate(chain.transforms):
            t.params = substate(params, f"{prefix}{i}.")


def save(pipe, path: str | Path) -> None:
    """Write `torchkv_config.json` and, when there are fitted parameters, `torchkv_params.safetensors`. A tensor
    that several chains share (tuned layers keep the preset's fitted transforms) is written once, under its first
    name; the file's "aliases" metadata maps the other names to it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(pipe.config(), indent=2))
    params = pipe.params()
    if params:
        first: dict[int, str] = {}
        aliases = {k: first.setdefault(id(v), k) for k, v in params.items()}
        aliases = {k: name for k, name in aliases.items() if name != k}
        tensors = {k: v.contiguous().cpu() for k, v in params.items() if k not in aliases}
        save_file(tensors, str(path / PARAMS_FILE), metadata={"aliases": json.dumps(aliases)})


def save_derived(pipe, src: str | Path, out: str | Path) -> None:
    """`save` `pipe`, a pipeline derived from the folder `src`, to `out`, with `src`'s other files (its
    `tune.json`), so that the copy reports its source's calibration domain and is refused on another model."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.name not in (CONFIG_FILE, PARAMS_FILE):
            shutil.copy(path, out / path.name)
    save(pipe, out)


def load(cls: type, path: str | Path):
    """The pipeline (of class `cls`) that `save` wrote to `path`."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{path} has no {CONFIG_FILE}; save a pipeline there with pipe.save_pretrained(path)")
    resave = "save the pipeline again with pipe.save_pretrained(path)"
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except ValueError as err:  # invalid JSON or not UTF-8 (truncated or garbled)
        raise ValueError(f"{path / CONFIG_FILE} is not valid JSON ({err}); {resave}") from err
    if not isinstance(config, dict) or config.get("format") != "torchkv.KVPipeline":
        raise ValueError(f"{path / CONFIG_FILE} is not a torchkv pipeline config of version {FORMAT_VERSION}")
    if isinstance(config.get("version"), int) and config["version"] > FORMAT_VERSION:
        raise ValueError(f"{path / CONFIG_FILE} was written in pipeline format version {config['version']} by a "
                         f"later torchkv; this one reads version {FORMAT_VERSION}: upgrade torchkv")
    if config.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path / CONFIG_FILE} is not a torchkv pipeline config of version {FORMAT_VERSION}")
    try:
        pipe = from_config(cls, config)
    except (KeyError, TypeError, AttributeError) as err:  # a field missing or of the wrong type
        raise ValueError(f"{path / CONFIG_FILE} is incomplete or malformed ({type(err).__name__}: {err}); "
                         f"{resave}") from err
    if (path / PARAMS_FILE).is_file():
        try:  # safetensors only: nothing here unpickles
            params = load_file(str(path / PARAMS_FILE))
            with safe_open(str(path / PARAMS_FILE), "pt") as f:
                aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
            params.update({k: params[name] for k, name in aliases.items()})
        except (SafetensorError, ValueError, KeyError) as err:  # SafetensorError is no ValueError
            raise ValueError(f"{path / PARAMS_FILE} is not a readable safetensors file of this pipeline's "
                             f"parameters ({type(err).__name__}: {err}); {resave}") from err
        if "layers" not in config:  # saved before per-layer chains: "first{n}." held the n-th first layer's
            params = {"layer" + k[len("first"):] if k.startswith("first") else k: v for k, v in params.items()}
        pipe.load_params(params)
    return pipe


def from_config(cls: type, config: Mapping[str, Any]):
    """A pipeline from its `config()` (parameters not included: see `load_params`)."""
    pipe = cls(
        side(config["keys"]),
        side(config["values"]),
        residual=config["residual"],
        sinks=config["sinks"],
        chunk=config["chunk"],
        window=None if config.get("window") is None else windows.from_spec(config["window"]),
        layers={int(layer): (side(c["keys"]), side(c["values"]))
                for layer, c in layer_specs(config).items()},
    )
    pipe.name, pipe.options, pipe.fitted_for = config["name"], dict(config["options"]), config.get("fitted_for")
    pipe.tuned_for = config.get("tuned_for")
    pipe.fitted_on, pipe.tuned_on = config.get("fitted_on"), config.get("tuned_on")
    return pipe


def side(spec: list | Mapping[str, Any]) -> list | HeadGroups:
    """One side from its spec: a list of transform specs (a chain), or `HeadGroups.spec()`'s dict."""
    if isinstance(spec, Mapping):
        return HeadGroups([(heads, [build(s) for s in chain]) for heads, chain in zip(spec["heads"], spec["chains"],
                                                                                      strict=True)])
    return [build(s) for s in spec]


def layer_specs(config: Mapping[str, Any]) -> dict[int, dict[str, list]]:
    """The per-layer chain specs of a config; configs saved before per-layer chains held a list of the first
    layers' ("first_layers"), or one ("first_layer")."""
    if "layers" in config:
        return {int(layer): specs for layer, specs in config["layers"].items()}
    first = config.get("first_layers") or ([config["first_layer"]] if config.get("first_layer") else [])
    return dict(enumerate(first))
