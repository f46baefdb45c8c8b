"""What a results row measures: a torchkv pipeline, or one of transformers' own caches as a baseline."""

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, QuantizedCache, StaticCache
from transformers.cache_utils import Cache

from torchkv.corpora import DEFAULT_DOMAIN
from torchkv.models import patched
from torchkv.models.batch_invariant import batch_invariant_linears
from torchkv.models.cache import TorchKVCache
from torchkv.models.patch import new_cache, resolve_pipeline
from torchkv.models.step import compile_decode_step
from torchkv.pipeline import KVPipeline

TUNED = "tuned:"
#: baseline rows: transformers' full-precision cache and its quanto-quantized cache (KIVI-like window 128)
BASELINES = {"dynamic": None, "quanto-4bit": 4, "quanto-2bit": 2}
#: a row whose whole decode step (model and cache) is one compiled graph over a fixed-capacity cache: this prefix on
#: a torchkv row, or this baseline, transformers' StaticCache (the fastest full-precision path of transformers)
COMPILED = "compiled:"
STATIC_BASELINE = "static-compiled"


@dataclass
class Method:
    """One row: `name` is its label; torchkv rows carry a pipeline, baselines a quanto bit width."""

    name: str
    pipeline: KVPipeline | None = None
    nbits: int | None = None
    #: a tuned row before `tune_for` runs: the row it starts from and the budget in stored bits per value
    tuning: tuple["Method", float] | None = None
    #: what tuning reported (`torchkv.fitting.tuning.tune`)
    tune_report: dict | None = None
    #: decode steps run as one compiled graph over a fixed-capacity cache (`COMPILED`, `STATIC_BASELINE`)
    compiled: bool = False
    #: the model's linear layers computed in fixed blocks of rows while the row is active (`models.batch_invariant`)
    batch_invariant: bool = False
    #: (model, its compiled decode step): every run of the row on that model reuses the step's graphs
    _step: tuple | None = field(default=None, repr=False, compare=False)

    def tune_for(self, model, tokenizer, tokens: int, out_dir: Path | None, progress: bool = True,
                 domain: str = DEFAULT_DOMAIN) -> None:
        """Tune a tuned row on `model` (on `tokens` of `domain`'s calibration split; one sensitivity measurement per
        starting row, model and domain serves every budget), and save its pipeline under `out_dir/tuned/` when
        given."""
        from torchkv.fitting.tuning import tuned_on_calibration_split

        start, budget = self.tuning
        self.pipeline, self.tune_report = tuned_on_calibration_split(
            start.pipeline, model, tokenizer, budget, tokens, progress, domain)
        self.pipeline.name = self.name
        if out_dir is not None:
            folder = out_dir / "tuned" / self.name.removeprefix(TUNED).replace("/", "_").replace(":", "_")
            self.pipeline.save_pretrained(folder)
            (folder / "tune.json").write_text(json.dumps(self.tune_report, indent=2))

    def reads_layer_input(self, model) -> bool:
        """The row's cache stores a function of each layer's input X (XQuant), which captures must record."""
        return self.pipeline is not None and "x" in self.pipeline.for_model(model).layers_require

    @property
    def kind(self) -> str:
        if self.pipeline is not None or self.tuning is not None:
            return "torchkv"
        if self.compiled:
            return "static"
        return "dynamic" if self.nbits is None else "quanto"

    def config(self) -> dict:
        if self.pipeline is not None:
            return self.pipeline.config()
        if self.compiled:
            return {"cache": "transformers.StaticCache", "compiled": "whole step"}
        if self.nbits is None:
            return {"cache": "transformers.DynamicCache"}
        return {"cache": "transformers.QuantizedCache", "backend": "quanto", "nbits": self.nbits,
                "q_group_size": 64, "residual_length": 128}

    @contextlib.contextmanager
    def active(self, model) -> Iterator[None]:
        """The model set up for this row (patched for torchkv rows)."""
        if self.pipeline is not None:
            setup = patched(model, self.pipeline, batch_invariant=self.batch_invariant)
        else:
            setup = batch_invariant_linears(model) if self.batch_invariant else contextlib.nullcontext()
        with setup:
            yield

    def filled_cache(self, model, layers: list[tuple[torch.Tensor, ...]]) -> Cache:
        """A fresh cache holding a prompt captured by `models.capture.capture_qkv`: every layer stores its
        `(queries, keys, values[, layer input])` through the same calls a patched forward pass makes."""
        cache = self.new_cache(model)
        for i, (q, k, v, *x) in enumerate(layers):
            if isinstance(cache, TorchKVCache):
                cache.layers[i].update(k, v)
                cache.layers[i].layer_input = x[0] if x else None
                cache.layers[i].commit(None, None, {"queries": q})
            else:
                cache.update(k, v, i)
        return cache

    def new_cache(self, model, simulated: bool = False, max_cache_len: int | None = None) -> Cache:
        """A fresh cache; `simulated` quantizes every token before any query reads it (torchkv rows); compiled rows
        need `max_cache_len`, their capacity."""
        if self.compiled and max_cache_len is None:
            raise ValueError(f"row {self.name!r} decodes on a fixed-capacity cache: pass max_cache_len")
        capacity = max_cache_len if self.compiled else None
        if self.pipeline is not None:
            pipe = self.pipeline
            if simulated:
                pipe = copy.copy(pipe)
                pipe.residual, pipe.sinks = 0, 0
            return new_cache(model, pipe, simulated, capacity)
        if self.compiled:
            return StaticCache(config=model.config, max_cache_len=capacity)
        if self.nbits is None:
            return DynamicCache(config=model.config)
        try:
            return QuantizedCache(backend="quanto", config=model.config, nbits=self.nbits)
        except ImportError as err:
            raise ImportError("the quanto baselines need optimum-quanto: pip install optimum-quanto") from err

    def decode_forward(self, model):
        """What runs a decode step: the model, or for compiled rows its forward compiled whole
        (`compile_decode_step`: static shapes, CUDA graphs on GPUs, window flushes from the host), with graphs of
        its own: rows sharing the forward's code object would share dynamo's
        limit of 8 graphs per code object (4 compiled rows x 3 contexts exceeded it)."""
        if not self.compiled:
            return model
        if self._step is None or self._step[0] is not model:
            self._step = (model, compile_decode_step(model))
        return self._step[1]


def method(name: str) -> Method:
    """A row by name: a baseline name (see `BASELINES`), a torchkv preset, optionally with overrides
    after colons (`kivi-2bit:residual=32:sinks=4`), a folder a pipeline was saved in (`torchkv calibrate`,
    `torchkv tune`), or `tuned:ROW@BITS`, ROW tuned to BITS stored bits per value on the model evaluated
    (`Method.tune_for`); `compiled:ROW` decodes ROW with the whole step compiled, and `static-compiled` is
    transformers' StaticCache decoded so."""
    if name == STATIC_BASELINE:
        return Method(name, compiled=True)
    if name.startswith(COMPILED):
        row = method(name.removeprefix(COMPILED))
        if row.pipeline is None:
            raise ValueError(f"{name!r}: only torchkv rows take {COMPILED!r}; the compiled baseline is {STATIC_BASELINE!r}")
        row.name, row.compiled = name, True
        return row
    if name.startswith(TUNED):
        start, sep, budget = name.removeprefix(TUNED).rpartition("@")
        try:
            bits = float(budget)
        except ValueError:
            bits = None
        if not sep or not start or bits is None:
            raise ValueError(f"a tuned row is written tuned:ROW@BITS, e.g. tuned:kivi-2bit@2.5; got {name!r}")
        base = method(start)
        if base.pipeline is None:
            raise ValueError(f"{name!r}: only torchkv rows can be tuned, and {start!r} is a baseline")
        return Method(name, tuning=(base, bits))
    if name in BASELINES:
        return Method(name, nbits=BASELINES[name])
    return Method(name, pipeline=resolve_pipeline(name))


def cache_nbytes(cache: Cache) -> int:
    """Bytes of storage of every tensor a cache holds, quanto's packed tensors included."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()

    def storage(t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        if hasattr(t, "__tensor_flatten__"):  # a tensor subclass: count its inner tensors
            return sum(storage(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        return t.untyped_storage().nbytes()

    total = 0
    for layer in cache.layers:
        for value in vars(layer).values():
            total += storage(value)
    return total
