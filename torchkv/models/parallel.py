"""Tensor parallelism (transformers' `tp_plan="auto"` under `torchrun`): what a rank's cache holds, and which
pipelines can compress a rank's share of the KV heads on their own.

Column-wise sharded `k_proj`/`v_proj` give each of the `tp` ranks `H / tp` whole KV heads (and their query
heads), so a rank's `TorchKVCache` sees `[B, H / tp, T, D]` keys and values and compresses only those; nothing
of the cache crosses ranks. A pipeline whose every step works per KV head decodes exactly as on one device.
Steps that read several heads at once see only the rank's heads: they still run, with a warning, and their
output differs from one device (measured by `benchmarks/tensor_parallel.py`). Steps that need what a rank
does not have are refused.
"""

import warnings

from torch import nn

from torchkv.pipeline import KVPipeline
from torchkv.pipeline.head_groups import HeadGroups


def tp_size(model: nn.Module) -> int:
    """Ranks the model's attention heads are split over by transformers' tensor parallelism (1 without it)."""
    return getattr(model, "tp_size", None) or 1


def _refusal(transform) -> str | None:
    """Why `transform` cannot encode a rank's share of the KV heads, or None."""
    if "x" in transform.requires or transform.fits_weights:
        return (f"{transform.kind}.{transform.name} rebuilds keys and values from the layer input X with the model's "
                "K/V projection weights, which tensor parallelism shards across ranks (as DTensors)")
    if transform.needs_fit:
        return (f"{transform.kind}.{transform.name} was calibrated on all of the model's KV heads at once (e.g. "
                "AQUA-KV's predictors read every head of the previous layer), and a rank holds only its own heads")
    return None


def _per_rank(transform) -> str | None:
    """How `transform` reads several KV heads at once (so a rank computes it over its own heads only), or None."""
    if (transform.kind, transform.name) == ("project", "svd"):
        return "SVDq's SVD basis spans the rank's KV heads, not all of them"
    if getattr(transform.config, "span", None) == "token":
        return f"{transform.kind}.{transform.name}(span='token') scales each token over the rank's KV heads"
    return None


def check_tensor_parallel(model: nn.Module, pipeline: KVPipeline) -> None:
    """Refuse a pipeline that cannot compress one rank's share of a tensor-parallel model's KV heads, and warn
    when it can but its output will differ from one device. Does nothing for a model without tensor parallelism.

    Raises:
        NotImplementedError: a transform needs what a rank does not hold, or the KV heads do not split evenly.
    """
    tp = tp_size(model)
    if tp == 1:
        return
    heads = model.config.get_text_config(decoder=True).num_key_value_heads
    if heads % tp:
        raise NotImplementedError(
            f"the model's {heads} KV heads do not split evenly over its {tp} tensor-parallel ranks; torchkv "
            f"compresses whole KV heads per rank: run with a number of ranks that divides {heads}"
        )
    transforms = [t for _, chain in pipeline.chains() for t in chain.transforms]
    refused = sorted({reason for t in transforms if (reason := _refusal(t))})
    if any(isinstance(chain, HeadGroups) for _, chain in pipeline.chains()):
        refused.append("its per-KV-head widths name the model's KV heads, and a rank holds a share of them")
    if refused:
        raise NotImplementedError(
            f"pipeline '{pipeline.name}' cannot compress a tensor-parallel model's KV cache ({tp} ranks, {heads // tp} "
            f"of {heads} KV heads each): {'; '.join(refused)}. Use a preset that works per KV head (kivi-*, squat-*, "
            "subkv-*, frontier-*, aquakv-2bit-nopred), or load the model without tp_plan"
        )
    mixed = sorted({reason for t in transforms if (reason := _per_rank(t))})
    if pipeline.window is not None and pipeline.window.reads_attention:
        mixed.append("the dynamic window decides from the attention of the rank's query heads, not all of them")
    if mixed:
        warnings.warn(
            f"pipeline '{pipeline.name}' on {tp} tensor-parallel ranks: {'; '.join(mixed)}, so generation may differ "
            "from one device (see benchmarks/tensor_parallel.py)", stacklevel=3)
