"""Fitting a pipeline to a model, above the model integration: `fit` calibrates the transforms that learn from a
model's activations (AQUA-KV's predictors, Alg. 1), and `tune` chooses per-layer, per-K/V widths under a stored-bits
budget (`torchkv tune`). `KVPipeline.fit` and `KVPipeline.tune` are thin delegates to these two."""

from torchkv.fitting.calibrate import fit_pipeline as fit
from torchkv.fitting.tuning import tune

__all__ = ["fit", "tune"]
