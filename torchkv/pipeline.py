"""KVPipeline: a key chain and a value chain of transforms, plus the cache's window settings."""

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchkv import registry
from torchkv.transforms import Context, Transform, build

CONFIG_FILE = "torchkv_config.json"
PARAMS_FILE = "torchkv_params.safetensors"
FORMAT_VERSION = 1
DEFAULT_PRESET = "kivi-4bit"
#: compiled code rounds through the stored metadata dtypes exactly as eager does
COMPILE_OPTIONS = {"emulate_precision_casts": True}


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _sub(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Entries of `state` under `prefix`, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _prefixed(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in state.items()}


class Chain:
    """Transforms applied in order to keys (or values); decode runs them in reverse.

    The encoded state holds each transform's state under `"{i}."` and the last output under `"out"`.
    """

    def __init__(self, transforms: list[Transform]):
        resolved: list[Transform] = []
        for t in transforms:
            if not isinstance(t, Transform):
                raise TypeError(f"a chain takes Transform objects, got {type(t).__name__}: {t!r}")
            if t.kind == "pack" and getattr(t.config, "bits", 0) is None:
                source = next((p for p in reversed(resolved) if hasattr(p, "code_bits")), None)
                if source is None:
                    raise ValueError(f"{t!r} needs a quantizer before it in the chain, or an explicit bits=")
                t = type(t)(**{**dataclasses.asdict(t.config), "bits": source.code_bits})
            resolved.append(t)
        self.transforms = resolved

    @property
    def token_multiple(self) -> int:
        return math.lcm(1, *(t.token_multiple for t in self.transforms))

    @property
    def needs_prepare(self) -> bool:
        return any(t.needs_prepare for t in self.transforms)

    @property
    def requires(self) -> frozenset[str]:
        return frozenset().union(*(t.requires for t in self.transforms))

    def dims(self, dim: int) -> list[int]:
        """Input feature size of every transform for a chain input of size `dim`."""
        sizes = []
        for t in self.transforms:
            sizes.append(dim)
            dim = t.out_dim(dim)
        return sizes

    def prepare(
        self, x: torch.Tensor, layer: int, valid: torch.Tensor | None, inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Per-sequence state of every transform that prepares, from the prompt's tensors `x: [B, H, T, F]`."""
        last = max((i for i, t in enumerate(self.transforms) if t.needs_prepare), default=-1)
        prepared: dict[str, torch.Tensor] = {}
        for i, (t, dim) in enumerate(zip(self.transforms[: last + 1], self.dims(x.shape[-1]))):
            ctx = Context(dim, layer, {}, valid, inputs)
            own = t.prepare(x, ctx)
            prepared.update(_prefixed(own, f"{i}."))
            if i < last:
                x, _ = t.encode(x, dataclasses.replace(ctx, prepared=own))
        return prepared

    def encode(
        self,
        x: torch.Tensor,
        layer: int,
        prepared: Mapping[str, torch.Tensor],
        valid: torch.Tensor | None,
        inputs: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """`x: [B, H, T, F]` -> encoded state (tensors with batch at dim 0, tokens at dim 2)."""
        state: dict[str, torch.Tensor] = {}
        for i, (t, dim) in enumerate(zip(self.transforms, self.dims(x.shape[-1]))):
            x, own = t.encode(x, Context(dim, layer, _sub(prepared, f"{i}."), valid, inputs))
            state.update(_prefixed(own, f"{i}."))
        state["out"] = x
        return state

    def decode(
        self,
        state: Mapping[str, torch.Tensor],
        dim: int,
        layer: int,
        prepared: Mapping[str, torch.Tensor],
        inputs: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """Encoded state -> `[B, H, T, dim]` float32."""
        y = state["out"]
        dims = self.dims(dim)
        for i in reversed(range(len(self.transforms))):
            ctx = Context(dims[i], layer, _sub(prepared, f"{i}."), None, inputs)
            y = self.transforms[i].decode(y, _sub(state, f"{i}."), ctx)
        return y.float()


@dataclasses.dataclass(frozen=True)
class BitsPerValue:
    """Measured stored bits per cached value, metadata included."""

    keys: float
    values: float

    @property
    def mean(self) -> float:
        return (self.keys + self.values) / 2


class KVPipeline:
    """How a KV cache is compressed: a key chain, a value chain and the window rules.

    Args:
        keys: transforms applied to each key chunk `[B, H, T, D]`, in order.
        values: transforms applied to each value chunk.
        residual: most recent tokens kept in full precision (KIVI's residual window).
        sinks: first tokens of the sequence kept in full precision.
        chunk: tokens encoded together; a multiple of every transform's token group.
            Default: the smallest such multiple.
        compile: run encode/decode through `torch.compile(fullgraph=True)`.
    """

    def __init__(
        self,
        keys: list[Transform],
        values: list[Transform],
        *,
        residual: int = 128,
        sinks: int = 0,
        chunk: int | None = None,
        compile: bool = False,
    ):
        self.keys, self.values = Chain(keys), Chain(values)
        for arg, value in (("residual", residual), ("sinks", sinks)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{arg}={value!r} must be a non-negative integer")
        multiple = math.lcm(self.keys.token_multiple, self.values.token_multiple)
        chunk = multiple if chunk is None else chunk
        if not isinstance(chunk, int) or chunk < 1 or chunk % multiple:
            raise ValueError(
                f"chunk={chunk!r} must be a positive multiple of {multiple}, the token group of the transforms"
            )
        self.residual, self.sinks, self.chunk, self.compile = residual, sinks, chunk, compile
        self.name = "custom"
        self.options: dict[str, Any] = {}
        self._compiled: dict[str, Any] = {}

    # -- presets -------------------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "KVPipeline":
        """The preset `name` (see `torchkv.presets()`), with keyword overrides of its options."""
        import torchkv.methods  # noqa: F401  (fills the preset registry)

        preset = registry.preset(name)
        options = preset.options()
        unknown = sorted(set(overrides) - set(options))
        if unknown:
            raise ValueError(f"preset '{name}' has no option(s) {unknown}; valid options: {sorted(options)}")
        pipe = preset.build(**overrides)
        pipe.name, pipe.options = name, {**options, **overrides}
        return pipe

    # -- encode / decode -----------------------------------------------------------------------------

    @property
    def needs_prepare(self) -> bool:
        return self.keys.needs_prepare or self.values.needs_prepare

    @property
    def requires(self) -> frozenset[str]:
        """Model-side inputs the transforms read (see `Transform.requires`)."""
        return self.keys.requires | self.values.requires

    def prepare(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layer: int = 0,
        valid: torch.Tensor | None = None,
        inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-sequence state from the prompt's keys and values `[B, H, T, D]` (SVDq basis, SQuat subspace)."""
        inputs = inputs or {}
        return {
            **_prefixed(self.keys.prepare(k, layer, valid, inputs), "k."),
            **_prefixed(self.values.prepare(v, layer, valid, inputs), "v."),
        }

    def _encode(self, k, v, layer, prepared, valid, inputs):
        return {
            **_prefixed(self.keys.encode(k, layer, _sub(prepared, "k."), valid, inputs), "k."),
            **_prefixed(self.values.encode(v, layer, _sub(prepared, "v."), valid, inputs), "v."),
        }

    def _decode(self, state, head_dim, layer, prepared, inputs):
        k = self.keys.decode(_sub(state, "k."), head_dim, layer, _sub(prepared, "k."), inputs)
        v = self.values.decode(_sub(state, "v."), head_dim, layer, _sub(prepared, "v."), inputs)
        return k, v

    def _run(self, name: str, *args):
        fn = getattr(self, name)
        if not self.compile:
            return fn(*args)
        if name not in self._compiled:
            self._compiled[name] = torch.compile(fn, fullgraph=True, dynamic=None, options=COMPILE_OPTIONS)
        return self._compiled[name](*args)

    def encode_chunk(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layer: int = 0,
        prepared: Mapping[str, torch.Tensor] | None = None,
        valid: torch.Tensor | None = None,
        inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Encode keys and values `[B, H, T, D]` (T a multiple of `chunk`) into one flat state dict.

        `valid: [B, T]` marks real tokens (False at padding). Keys' entries start with "k.", values' with "v.".
        """
        _check_kv(k, v)
        if k.shape[2] % self.chunk:
            raise ValueError(f"encode_chunk got {k.shape[2]} tokens; it takes a multiple of chunk={self.chunk}")
        return self._run("_encode", k, v, layer, dict(prepared or {}), valid, dict(inputs or {}))

    def decode_chunk(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        head_dim: int,
        layer: int = 0,
        prepared: Mapping[str, torch.Tensor] | None = None,
        inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of `encode_chunk`: `(k, v)`, each `[B, H, T, head_dim]` float32."""
        return self._run("_decode", dict(state), head_dim, layer, dict(prepared or {}), dict(inputs or {}))

    # -- accounting ----------------------------------------------------------------------------------

    def bits_per_value(self, kv_heads: int = 1, head_dim: int = 64, seed: int = 0) -> BitsPerValue:
        """Stored bits per value of one encoded chunk of Gaussian data, measured on the real state tensors."""
        gen = torch.Generator().manual_seed(seed)
        k, v = (torch.randn(1, kv_heads, self.chunk, head_dim, generator=gen) for _ in range(2))
        inputs = {}
        if {"cos", "sin"} & self.requires:  # the identity rotation: position 0 everywhere
            inputs = {"cos": torch.ones(1, self.chunk, head_dim), "sin": torch.zeros(1, self.chunk, head_dim)}
        prepared = self.prepare(k, v, inputs=inputs) if self.needs_prepare else {}
        state = self.encode_chunk(k, v, prepared=prepared, inputs=inputs)
        n = k.numel()
        return BitsPerValue(8 * _nbytes(_sub(state, "k.")) / n, 8 * _nbytes(_sub(state, "v.")) / n)

    # -- persistence ---------------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The JSON configuration `save_pretrained` writes."""
        return {
            "format": "torchkv.KVPipeline",
            "version": FORMAT_VERSION,
            "name": self.name,
            "options": self.options,
            "residual": self.residual,
            "sinks": self.sinks,
            "chunk": self.chunk,
            "keys": [t.spec() for t in self.keys.transforms],
            "values": [t.spec() for t in self.values.transforms],
        }

    def params(self) -> dict[str, torch.Tensor]:
        """Fitted parameters of every transform, keyed "k.{i}.{name}" / "v.{i}.{name}"."""
        out = {}
        for side, chain in (("k", self.keys), ("v", self.values)):
            for i, t in enumerate(chain.transforms):
                out.update(_prefixed(t.params, f"{side}.{i}."))
        return out

    def save_pretrained(self, path: str | Path) -> None:
        """Write `torchkv_config.json` and, when there are fitted parameters, `torchkv_params.safetensors`."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.config(), indent=2))
        params = self.params()
        if params:
            save_file({k: v.contiguous().cpu() for k, v in params.items()}, str(path / PARAMS_FILE))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "KVPipeline":
        """Load what `save_pretrained` wrote."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG_FILE).is_file():
            raise ValueError(f"{path} has no {CONFIG_FILE}; save a pipeline there with pipe.save_pretrained(path)")
        config = json.loads((path / CONFIG_FILE).read_text())
        if config.get("format") != "torchkv.KVPipeline" or config.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path / CONFIG_FILE} is not a torchkv pipeline config of version {FORMAT_VERSION}")
        pipe = cls(
            [build(s) for s in config["keys"]],
            [build(s) for s in config["values"]],
            residual=config["residual"],
            sinks=config["sinks"],
            chunk=config["chunk"],
        )
        pipe.name, pipe.options = config["name"], config["options"]
        if (path / PARAMS_FILE).is_file():
            params = load_file(str(path / PARAMS_FILE))
            for side, chain in (("k", pipe.keys), ("v", pipe.values)):
                for i, t in enumerate(chain.transforms):
                    t.params = _sub(params, f"{side}.{i}.")
        return pipe

    def __repr__(self) -> str:
        def chain(c: Chain) -> str:
            return "[" + ", ".join(repr(t) for t in c.transforms) + "]"

        return (
            f"KVPipeline(name={self.name!r}, residual={self.residual}, sinks={self.sinks}, chunk={self.chunk},\n"
            f"  keys={chain(self.keys)},\n  values={chain(self.values)})"
        )


def _check_kv(k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor [batch, kv_heads, tokens, head_dim], got {shape}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point (float32, bfloat16 or float16), got {t.dtype}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on [batch, kv_heads, tokens]; got {tuple(k.shape)} and {tuple(v.shape)}")


def presets() -> list[dict[str, Any]]:
    """Every registered preset: name, one-line description, nominal bits per value, options."""
    import torchkv.methods  # noqa: F401  (fills the preset registry)

    return [
        {
            "name": p.name,
            "description": p.description,
            "nominal_bits": p.nominal_bits,
            "options": p.options(),
        }
        for p in map(registry.preset, registry.preset_names())
    ]
