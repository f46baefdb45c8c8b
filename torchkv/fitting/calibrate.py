"""Calibration of cross-layer predictors (AQUA-KV Alg. 1), one layer after another on reconstructed inputs.

The model runs one decoder layer at a time over the calibration tokens, whose hidden states are the only
activations held across layers (`[N, T, hidden]`). At each layer the pre-RoPE keys and values are captured,
the layer's predictors are fitted by ridge regression from streamed moments (`Σ z̃z̃ᵀ`, `Σ z̃yᵀ`, one batch
at a time) on the previous layer's *reconstructions*, and the pipeline itself then encodes the layer to
produce the reconstructions the next layer is fitted on — the same arithmetic the cache runs at inference.
"""

import contextlib
import math
import resource
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from torchkv import registry
from torchkv.models import arch
from torchkv.ops import apply_rope, ridge_streamed
from torchkv.pipeline import KVPipeline, LayerState

CALIBRATE_NAME = "torchkv_calibrate"


class _Stop(Exception):
    """Ends a forward pass once the first layer's inputs are recorded."""


@contextlib.contextmanager
def _recording(model: nn.Module, records: dict) -> Iterator[list[nn.Module]]:
    """Every decoder layer's call (args, kwargs) and every attention call's (key, value) go to `records`;
    attention itself runs as SDPA with the model's own masks (dense, for logit soft-capping: Gemma 2)."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        records[("kv", module.layer_idx)] = (key, value)
        return arch.sdpa_with_softcap(module, query, key, value, attention_mask, **kwargs)

    layers = list(arch._get(model, arch.arch_of(model).layers))

    def hook(i):
        def pre(module, args, kwargs):
            records[("call", i)] = (args, kwargs)
            if records.get("stop_at") == i:
                raise _Stop

        return pre

    hooks = [(layer, hook(i)) for i, layer in enumerate(layers)]
    with arch.swapped_attention(model, CALIBRATE_NAME, attention, hooks):
        yield layers


def token_windows(tokenizer, texts, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping windows of `seq_len` tokens of the texts (token ids [N, T] are used as they are)."""
    if isinstance(texts, torch.Tensor):
        ids = texts.long()
        if ids.dim() != 2:
            raise ValueError(f"calibration token ids must be [sequences, tokens], got {tuple(ids.shape)}")
        return ids[: max(1, max_tokens // ids.shape[1])]
    if tokenizer is None:
        raise ValueError("calibrating on texts needs the model's tokenizer: pipe.fit(model, texts, tokenizer=tokenizer)")
    if max_tokens < seq_len:
        raise ValueError(f"max_tokens={max_tokens} is less than one window of seq_len={seq_len} tokens: raise the "
                         "calibration tokens (--tokens) or lower the window (--seq-len)")
    stream = tokenizer("\n\n".join(texts), return_tensors="pt", add_special_tokens=False).input_ids[0]
    count = min(stream.numel(), max_tokens) // seq_len
    if count < 1:
        raise ValueError(f"the calibration texts hold {stream.numel()} tokens; at least seq_len={seq_len} are needed")
    return stream[: count * seq_len].view(count, seq_len)


def _predictor(chain) -> Any:
    """The chain's predict transform, which must read the chain's projection-space input, or None."""
    predicts = [i for i, t in enumerate(chain.transforms) if t.kind == "predict"]
    if not predicts:
        return None
    if predicts != [chain.carry_index]:
        raise ValueError(f"calibration fits one predict transform right after the position-dependent ones; got {chain.transforms}")
    return chain.transforms[chain.carry_index]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, F] -> [B·T, H·F]: one row per token, heads and features flattened (as `predict.linear` reads
    its sources), the layout of the regression targets."""
    return x.float().transpose(1, 2).flatten(2).flatten(0, 1)


@registry.register_delegate("fit")
@torch.no_grad()  # the model runs for its keys and values only; nothing here is differentiated
def fit_pipeline(
    pipe: KVPipeline,
    model: nn.Module,
    texts,
    *,
    tokenizer=None,
    seq_len: int = 1024,
    max_tokens: int = 32768,
    batch: int = 4,
    alpha: float = 1e-3,
    progress: bool = True,
    domain: str | None = None,
) -> dict[str, Any]:
    """Fit the pipeline's predict transforms on `model` (AQUA-KV Alg. 1) and mark it calibrated for it.

    Args:
        pipe: a pipeline whose key and/or value chain has a `predict.linear` transform.
        model: an unpatched Hugging Face causal LM (see `torchkv.models.arch.ARCHITECTURES`).
        texts: strings (tokenized with `tokenizer`, cut into `seq_len`-token windows) or token ids [N, T].
        max_tokens: calibration tokens used at most; batch: windows per forward of one layer.
        alpha: ridge damping relative to the mean diagonal of the moment matrix.
        domain: what the texts are (a `torchkv.corpora` domain or your own label), kept as `pipe.fitted_on`.

    Returns:
        a report: tokens, seconds, peak resident memory (of the process), and per layer and side the relative
        error ‖x̂ − x‖²/‖x‖² of the reconstruction ("error") and, for layers with predictors, the predictor's
        ‖y − ŷ‖²/‖y‖² ("predictor_error") and its "equivalent bits" −log₄ of it, on the calibration tokens.
    """
    key_predictor, value_predictor = _predictor(pipe.keys), _predictor(pipe.values)
    if key_predictor is None and value_predictor is None:
        raise ValueError(f"pipeline '{pipe.name}' has nothing to calibrate (no predict transform)")
    start = time.perf_counter()
    ids = token_windows(tokenizer, texts, seq_len, max_tokens).to(next(model.parameters()).device)
    batch = min(batch, ids.shape[0])  # one batch size: every layer call replays the first batch's arguments
    batches = list(ids[: ids.shape[0] // batch * batch].split(batch))
    records: dict = {}
    report: dict[str, Any] = {"tokens": sum(b.numel() for b in batches), "seq_len": batches[0].shape[1], "layers": []}
    with _recording(model, records) as layers:
        calls, hidden = _layer_calls(model, batches, records, len(layers))
        carry: list[dict[str, torch.Tensor]] = []
        for layer_idx in tqdm(range(len(layers)), desc="calibrating", unit="layer", disable=not progress):
            kwargs = {k: v for k, v in calls[layer_idx].items() if k != "hidden_states"}
            if "position_embeddings" not in kwargs:
                raise NotImplementedError(f"{type(model).__name__} does not pass position embeddings to its layers")
            cos, sin = kwargs["position_embeddings"]
            kv = []
            for i, h in enumerate(hidden):
                out = layers[layer_idx](h, **kwargs)
                hidden[i] = out[0] if isinstance(out, tuple) else out
                k_post, v = records.pop(("kv", layer_idx))
                kv.append((k_post.float(), v.float()))
            carry = _fit_layer(pipe, layer_idx, kv, carry, (cos, sin), key_predictor, value_predictor, alpha, report)
    pipe.fitted_for, pipe.fitted_on = arch.fingerprint(model), domain
    report["seconds"] = time.perf_counter() - start
    report["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return report


def _layer_calls(model: nn.Module, batches: list[torch.Tensor], records: dict, layers: int):
    """`(calls, hidden)`: every layer's keyword arguments, recorded on the first batch, and the first layer's
    input hidden states for each batch (the forward stops there)."""
    model(input_ids=batches[0], use_cache=False, logits_to_keep=1)
    calls = [records[("call", i)][1] for i in range(layers)]
    records.clear()
    records["stop_at"] = 0
    hidden = []
    for b in batches:
        with contextlib.suppress(_Stop):
            model(input_ids=b, use_cache=False)
        args, kwargs = records[("call", 0)]
        hidden.append(args[0] if args else kwargs["hidden_states"])
    del records["stop_at"]
    return calls, hidden


def _fit_layer(pipe, layer, kv, carry, rope, key_predictor, value_predictor, alpha, report):
    """Fit one layer's predictors on the previous layer's reconstructions `carry`; return this layer's."""
    cos, sin = rope
    layer_pipe = pipe.for_layer(layer)
    keys = [apply_rope(k, cos, -sin) for k, _ in kv]  # pre-RoPE targets [B, H, T, D]
    values = [v for _, v in kv]

    def reconstruct() -> list[dict[str, torch.Tensor]]:
        out = []
        for (k_post, v), previous in zip(kv, carry or [{}] * len(kv)):
            inputs = {"cos": cos, "sin": sin, **{f"previous.{s}": t for s, t in previous.items()}}
            state = layer_pipe.codec.encode(k_post, v, LayerState(layer_pipe.layer_params(layer), {}, inputs), None)  # eager
            out.append({s: state[f"carry.{s}"] for s in ("k", "v")})
        return out

    row: dict[str, Any] = {"layer": layer, "keys": {}, "values": {}}
    if layer and key_predictor is not None:
        pairs = [(key_predictor.features({"previous": p["k"]}).flatten(0, 1), _rows(k)) for k, p in zip(keys, carry)]
        key_predictor.fit_layer(layer, *ridge_streamed(pairs, alpha))
        row["keys"] = _predictor_error(key_predictor, layer, pairs)
    if layer and value_predictor is not None:
        own = reconstruct()  # this layer's keys as the fitted key predictor reconstructs them
        pairs = [
            (value_predictor.features({"previous": p["v"], "keys": o["k"]}).flatten(0, 1), _rows(v))
            for v, p, o in zip(values, carry, own)
        ]
        value_predictor.fit_layer(layer, *ridge_streamed(pairs, alpha))
        row["values"] = _predictor_error(value_predictor, layer, pairs)
    out = reconstruct()
    for side, name, targets in (("k", "keys", keys), ("v", "values", values)):
        err = sum(float((o[side] - t).pow(2).sum()) for o, t in zip(out, targets))
        row[name]["error"] = err / sum(float(t.pow(2).sum()) for t in targets)
    report["layers"].append(row)
    return out


def _predictor_error(predictor, layer: int, pairs) -> dict[str, float]:
    """‖y − ŷ‖²/‖y‖² of the stored (rounded) predictor over the calibration rows, and −log₄ of it."""
    weight, bias = predictor.params[f"{layer}.weight"].float(), predictor.params[f"{layer}.bias"].float()
    err = sum(float(((z @ weight + bias) - y).pow(2).sum()) for z, y in pairs)
    rel = err / max(sum(float(y.pow(2).sum()) for _, y in pairs), 1e-30)
    return {"predictor_error": rel, "equivalent_bits": -math.log(rel) / math.log(4)}
