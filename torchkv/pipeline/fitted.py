"""Whether a pipeline is ready for a model: calibrated (`torchkv.fit`) and tuned (`torchkv.tune`) for that model."""

from collections.abc import Mapping
from typing import Any


def check_fitted(pipe, num_layers: int, fingerprint: dict[str, Any]) -> None:
    """Raise a clear error unless every transform that needs calibration is fitted, and the per-layer chains
    of a tuned pipeline were chosen, for this model.

    Args:
        num_layers: decoder layers of the model the cache is for.
        fingerprint: `torchkv.models.arch.fingerprint(model)` of that model.
    """
    if pipe.tuned_for is not None and pipe.tuned_for != fingerprint:
        raise ValueError(f"pipeline '{pipe.name}' was tuned for another model "
                         f"({differences(pipe.tuned_for, fingerprint)}); tune it for this one: "
                         f"`torchkv tune --preset {pipe.name} --budget BITS --out DIR`")
    unfitted = pipe.to_fit()
    if not unfitted:
        return
    how = (f"calibrate it first: pipe.fit(model, texts), or `torchkv calibrate --preset {pipe.name} --out DIR` "
           "and load DIR")
    if pipe.fitted_for is None:
        raise ValueError(f"pipeline '{pipe.name}' has uncalibrated transforms {unfitted}; {how}")
    if pipe.fitted_for != fingerprint:
        raise ValueError(f"pipeline '{pipe.name}' was calibrated for another model "
                         f"({differences(pipe.fitted_for, fingerprint)}); {how}")
    missing = [layer for layer in range(1, num_layers) for t in unfitted if not t.layer_params(layer)]
    if missing:
        raise ValueError(f"pipeline '{pipe.name}' has no fitted parameters for layers {sorted(set(missing))}; {how}")


def differences(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> str:
    """The fields two model fingerprints differ in, with both values."""
    diff = sorted(k for k in {**expected, **actual} if expected.get(k) != actual.get(k))
    return (f"differs in {diff}: expected { {k: expected.get(k) for k in diff} }, "
            f"this model { {k: actual.get(k) for k in diff} }")
