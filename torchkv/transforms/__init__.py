"""Registered transforms, one file per kind, and one factory per kind.

Usage: `import torchkv.transforms as T; T.quantize(bits=2, axis="channel", group=32)`.
"""

from typing import Any

from torchkv.registry import transform_class
from torchkv.transforms import packers, predictors, projections, quantizers, rotations  # noqa: F401  (registers the built-ins)
from torchkv.transforms.base import Context, ProjectionWeights, Transform, TransformConfig


def rotate(name: str = "hadamard", **config: Any) -> Transform:
    """A registered rotate transform, e.g. `rotate("hadamard")`."""
    return transform_class("rotate", name)(**config)


def project(name: str, **config: Any) -> Transform:
    """A registered project transform (change of basis or subspace)."""
    return transform_class("project", name)(**config)


def predict(name: str, **config: Any) -> Transform:
    """A registered predict transform (subtract what other layers predict)."""
    return transform_class("predict", name)(**config)


def quantize(name: str = "uniform", **config: Any) -> Transform:
    """A registered quantize transform, e.g. `quantize(bits=2, axis="channel", group=32)`."""
    return transform_class("quantize", name)(**config)


def pack(name: str = "bits", **config: Any) -> Transform:
    """A registered pack transform; `pack()` packs the codes of the quantizer before it."""
    return transform_class("pack", name)(**config)


def build(spec: dict[str, Any]) -> Transform:
    """A transform from its `spec()` (kind, name, config), as `from_pretrained` reads it."""
    return transform_class(spec["kind"], spec["name"])(**spec.get("config", {}))


__all__ = ["Context", "ProjectionWeights", "Transform", "TransformConfig", "build", "pack", "predict", "project", "quantize", "rotate"]
