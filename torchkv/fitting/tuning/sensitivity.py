"""How much each layer's keys and each layer's values cost in next-token KL divergence at each candidate width.

The cost of storing layer ℓ's keys (or values) with candidate c is the KL divergence of the model's next-token
distributions from the full-precision ones when only that side of that layer is compressed. To second order it
is `½ δᵀ F δ`, with δ the reconstruction error of the whole sequence and F the Fisher information of the
outputs with respect to the layer's keys (values). A backward pass of the summed log-likelihood of labels drawn
from the model's own distribution gives a gradient g with `E[g gᵀ] = F`, so `½ (g · δ)²` is an unbiased
estimate of the cost, for every candidate from the same pass; the estimate is averaged over `DRAWS` draws per
calibration sequence. The dot product runs over every token and KV head of a sequence together: errors shared
by many tokens act together (a value error common to the tokens a query attends to moves its output by all of
it), while a key error common to all tokens moves no softmax. An estimate per token, dropping the cross terms,
favoured 1-bit values and wide key groups whose errors are shared, and tuned KIVI lost to uniform KIVI.

g counts only the (query, key) pairs that decoding reads from the encoded store (`exposed_pairs`: a query reads
its sinks and its window exact). With every pair counted, as before, the cost was dominated by queries near
their keys, which the window serves exact, and long-range reads were underweighted: frontier-2bit tuned to 2.5
bits on mixed text found 0.33 / 0.93 / 0.60 of 4K needles (wiki / code / docs; full precision 1.00 / 0.87 /
0.80); counting exposed pairs only, 0.80 / 1.00 / 0.73 (`benchmarks/results/domains/`).

Each position's KL weighs the number of encoded keys it reads, over the mean (`read_weights`): in a 2,048-token
window the average query reads about 900 encoded tokens, where a query at 8K reads up to 8,000, so the positions
that read most of the store stand for long contexts best. Weighted so, frontier-2bit tuned per head to 2.5 bits
on mixed text lost at most +1.69% perplexity (prompt mode) and +1.82% (streaming) on wiki, code and docs at 2K and
8K, against +2.02% and +2.02% with every position weighing the same (`benchmarks/results/domains/ablations/`).
"""

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from torchkv._compat import config_head_dim
from torchkv.models import arch
from torchkv.pipeline import KVPipeline, LayerState, side_of
from torchkv.store import flushed
from torchkv.fitting.tuning.candidates import Candidate, layer_candidates, tuned_chunk

TUNE_NAME = "torchkv_tune"
#: positions whose logits exist at once in `_sampled_gradients` (a [LOGIT_CHUNK, vocabulary] float32 tensor)
LOGIT_CHUNK = 256
#: label draws (backward passes) per calibration batch
DRAWS = 2


@dataclasses.dataclass
class Probe:
    """One layer's attention inputs `[B, H(q), T, D]`, its mask (`[B, 1, T, T]` bool or additive, or None: causal)
    and scale, and the zero leaf added to its output `[B, T, Hq, D]`, whose gradient is the loss's with respect
    to the output; `x`: the attention block's input `[B, T, d]`; `softcap`: the model's attention logit soft-capping
    `c·tanh(s/c)` (Gemma 2), or None."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    scaling: float
    out: torch.Tensor
    x: torch.Tensor | None = None
    softcap: float | None = None


@contextlib.contextmanager
def _probed(model: nn.Module, probes: dict[int, Probe]) -> Iterator[None]:
    """Attention runs as SDPA (dense where the model soft-caps its logits) plus a zero leaf and records a `Probe`
    per layer; the model's parameters are frozen meanwhile (gradients flow from the probes on only)."""
    inputs: dict[int, torch.Tensor] = {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        softcap = kwargs.get("softcap")
        if softcap is None:
            out, weights = arch.sdpa_with_softcap(module, query, key, value, attention_mask, **kwargs)
        else:  # dense: its [B, Hq, T, T] probabilities are recomputed in the backward pass, not held per layer
            out, weights = checkpoint(arch.sdpa_with_softcap, module, query, key, value, attention_mask,
                                      use_reentrant=False, **kwargs)
        leaf = torch.zeros_like(out, requires_grad=True)
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        probes[module.layer_idx] = Probe(query.detach(), key.detach(), value.detach(), attention_mask, scaling, leaf,
                                         inputs.pop(module.layer_idx, None), softcap)
        return out + leaf, weights

    def record_input(i: int):
        def pre(module, args, kwargs):
            inputs[i] = arch.attention_input(args, kwargs).detach()

        return pre

    frozen = [(p, p.requires_grad) for p in model.parameters()]
    hooks = [(m, record_input(i)) for i, m in enumerate(arch.attention_modules(model))]
    with arch.swapped_attention(model, TUNE_NAME, attention, hooks):
        try:
            for p, _ in frozen:
                p.requires_grad_(False)
            yield
        finally:
            for p, flag in frozen:
                p.requires_grad_(flag)


@dataclasses.dataclass
class Sensitivity:
    """Measured costs of a pipeline's candidate settings on one model.

    Attributes:
        pipeline: the pipeline tuned from (for the model: `KVPipeline.for_model`).
        candidates: per layer, each side's candidates ("k", "v"), cheapest first.
        costs: per layer and side, the estimated KL divergence (nats per scored token) of each candidate.
        head_costs: the same split by KV head, `½ (g_h·δ_h)²` (`[H]` per candidate): what `torchkv tune
            --per-head` allocates; empty where not measured (read back from a report). They drop the cross terms
            between heads that `costs` keeps.
        tokens: scored calibration tokens, in windows of `seq_len`; seconds: the measurement's duration.
        also: pipelines whose candidates were measured too, on the same windows (`layer_candidates`).
    """

    pipeline: KVPipeline
    candidates: list[dict[str, list[Candidate]]]
    costs: list[dict[str, list[float]]]
    tokens: int
    seq_len: int
    seconds: float
    head_costs: list[dict[str, list[torch.Tensor]]] = dataclasses.field(default_factory=list)
    also: tuple[KVPipeline, ...] = ()


def _flush_span(pipe: KVPipeline, tokens: int) -> tuple[int, int]:
    """Token range [start, end) of a `tokens`-token prompt that the cache stores encoded (`KVStore.append`)."""
    total = tokens - min(pipe.sinks, tokens)
    return tokens - total, tokens - total + flushed(total, pipe.residual + pipe.chunk, pipe.chunk)


def _reconstruct(pipe: KVPipeline, layer: int, probe: Probe, span: tuple[int, int], inputs: dict,
                 side: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The reconstruction error `[B, H, T', D]` of the layer's keys ("k") and values ("v") over `span` as `pipe`
    stores and rebuilds them (only `side`'s where given and the pipeline does not predict across layers), and
    its carry for the next layer (pipelines that predict across layers)."""
    start, end = span
    whole = {n: t for n, t in inputs.items() if not n.startswith("previous.")}  # the prompt, as `prepare` reads it
    own = {n: (t[:, start:end] if n in ("cos", "sin", "x") else t) for n, t in inputs.items() if n != "queries"}
    x = {"k": probe.key, "v": probe.value}
    params = pipe.layer_params(layer)
    if side is not None and not pipe.carries:
        chain = pipe.keys if side == "k" else pipe.values
        p = side_of(LayerState(params, {}, whole), side)
        prepared = chain.prepare(x[side].float(), p, None) if chain.needs_prepare else {}
        target, mine = x[side][:, :, start:end].float(), LayerState(p.params, prepared, own)
        return {side: chain.decode(chain.encode(target, mine, None), target.shape[-1], mine) - target}, {}
    prepared = pipe.prepare(x["k"].float(), x["v"].float(), layer=layer, inputs=whole) if pipe.needs_prepare else {}
    k, v = (x[s][:, :, start:end].float() for s in ("k", "v"))
    state = pipe.codec.encode(k, v, LayerState(params, prepared, own), None)
    carry = {s: state.pop(f"carry.{s}") for s in ("k", "v") if f"carry.{s}" in state}
    k_hat, v_hat, *_ = pipe.codec.decode(state, k.shape[-1], LayerState(params, prepared, own))
    return {"k": k_hat - k, "v": v_hat - v}, carry


def _trials(pipe: KVPipeline, layer: int, options: dict[str, list[Candidate]]) -> dict[tuple[str, int], KVPipeline]:
    """An eager pipeline per (side, candidate index): the candidate on that side, the layer's own chain on the other."""
    base = pipe.for_layer(layer)
    out = {}
    for side, cands in options.items():
        for j, c in enumerate(cands):
            keys, values = (c.transforms, base.values.transforms) if side == "k" else (base.keys.transforms, c.transforms)
            trial = KVPipeline(list(keys), list(values), residual=pipe.residual, sinks=pipe.sinks,
                               chunk=tuned_chunk(pipe, [c.transforms]), compile=False)
            trial.carries = pipe.carries
            out[side, j] = trial
    return out


@torch.no_grad()
def _layer_costs(pipe, layer, probe, trials, grads, tokens, inputs, costs, head_costs) -> dict:
    """Add this layer's `½ (g·δ)²` of every candidate, per sequence and averaged over the draws' gradients `grads`
    (`(g_k, g_v)` each), to `costs`, and each KV head's `½ (g_h·δ_h)²` to `head_costs`, over the tokens each trial's
    cache would store encoded from a `tokens`-token prompt; return the base pipeline's carry for the next layer."""
    for (side, j), trial in trials.items():
        start, end = span = _flush_span(trial, tokens)
        delta = _reconstruct(trial, layer, probe, span, inputs, side)[0][side]
        for dk, dv in grads:
            g = (dk if side == "k" else dv)[:, :, start:end].float()
            product = g * delta  # [B, H, T', D]
            costs[side][j] += 0.5 * float(product.sum((1, 2, 3)).pow(2).sum()) / len(grads)
            head_costs[side][j] += 0.5 * product.sum((2, 3)).pow(2).sum(0).cpu() / len(grads)
    if not pipe.carries:
        return {}
    return _reconstruct(pipe.for_layer(layer), layer, probe, _flush_span(pipe, tokens), inputs)[1]


def exposed_pairs(pipe: KVPipeline, tokens: int) -> torch.Tensor:
    """`[T, T]` bool: the pairs (query i, key j) where decoding token i reads key j from the encoded store, token by
    token from the start (`KVStore.append`): j after the sinks and among the tokens flushed once i is held."""
    position = torch.arange(tokens)
    held = (position + 1 - pipe.sinks).clamp_min(0)  # [T]: tokens after the sinks once query i is appended
    limit = pipe.residual + pipe.chunk
    encoded = torch.where(held >= limit, torch.div(held - limit, pipe.chunk, rounding_mode="floor") * pipe.chunk
                          + pipe.chunk, 0)  # `store.flushed`
    key = position[None]
    return (key >= pipe.sinks) & (key < pipe.sinks + encoded[:, None])


def _exposed_gradients(probe: Probe, out_grad: torch.Tensor, exposed: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss's gradients `(g_k, g_v)` `[B, H, T, D]` with respect to perturbations of the keys and values that
    only the exposed pairs read: `S = s·(Q Kᵀ + E ⊙ Q ΔKᵀ)` (soft-capped as the model does), `O = P V + (P ⊙ E) ΔV`
    at ΔK = ΔV = 0, from the output's gradient `out_grad` `[B, T, Hq, D]`, in blocks of `LOGIT_CHUNK` queries."""
    q, k, v = (t.float() for t in (probe.query, probe.key, probe.value))
    groups, tokens = q.shape[1] // k.shape[1], q.shape[2]
    dk, dv = (torch.zeros_like(t, requires_grad=True) for t in (k, v))
    allowed = torch.ones(tokens, tokens, dtype=torch.bool, device=q.device).tril()
    if probe.mask is not None:
        mask = probe.mask[..., -tokens:, -tokens:]
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    g_out = out_grad.float().transpose(1, 2)  # [B, Hq, T, D]
    exposed = exposed.to(q.device)
    with torch.enable_grad():
        k_all, v_all = (t.repeat_interleave(groups, 1) for t in (k, v))
        dk_all, dv_all = (t.repeat_interleave(groups, 1) for t in (dk, dv))
        for rows in torch.arange(tokens, device=q.device).split(LOGIT_CHUNK):
            e = exposed[rows].float()  # [R, T]
            qr = q[:, :, rows]
            scores = probe.scaling * (qr @ k_all.transpose(-1, -2) + e * (qr @ dk_all.transpose(-1, -2)))
            if probe.softcap:
                scores = probe.softcap * torch.tanh(scores / probe.softcap)
            p = torch.softmax(scores.masked_fill(~allowed[..., rows, :], float("-inf")), -1)
            out = p @ v_all + (p * e) @ dv_all
            (out * g_out[:, :, rows]).sum().backward()
    return dk.grad, dv.grad


def read_weights(exposed: torch.Tensor) -> torch.Tensor:
    """`[T]` float32: each query position's count of encoded keys read (the rows of `exposed` `[T, T]`) over its
    mean (`measure` refuses windows where no position reads any)."""
    reads = exposed.sum(1, dtype=torch.float32)
    return reads / reads.mean()


def _sampled_gradients(model: nn.Module, ids: torch.Tensor, probes: dict[int, Probe], generator: torch.Generator,
                       draws: int, exposed: torch.Tensor) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run `ids` [B, T]; for each of `draws` draws of every position's label from the model's own next-token
    distribution, back-propagate the cross-entropy summed over positions with weights `read_weights(exposed)`
    (g's sign is squared away) to the probes. Returns, per layer, the `(g_k, g_v)` gradients of each draw over the
    `exposed` pairs (`_exposed_gradients`). Vocabulary-wide tensors exist for `LOGIT_CHUNK` positions at a time."""
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state  # [B, T, d]
    head = model.get_output_embeddings()
    softcap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    grads: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in probes]
    weights = read_weights(exposed).to(hidden.device)  # [T]: the gradient of Σ_i w_i CE_i is w_i ∂CE_i/∂h_i
    for draw in range(draws):
        leaf = hidden.detach().flatten(0, 1).requires_grad_()
        for part in leaf.split(LOGIT_CHUNK):
            logits = head(part).float()  # [LOGIT_CHUNK, V]
            if softcap:
                logits = softcap * torch.tanh(logits / softcap)
            with torch.no_grad():
                labels = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
            torch.nn.functional.cross_entropy(logits, labels, reduction="sum").backward()
        for probe in probes.values():
            probe.out.grad = None
        hidden.backward(leaf.grad.view_as(hidden) * weights[:, None], retain_graph=draw + 1 < draws)
        for i, probe in probes.items():
            grads[i].append(_exposed_gradients(probe, probe.out.grad, exposed))
    return grads


def measure(pipe: KVPipeline, model: nn.Module, ids: torch.Tensor, *, batch: int = 1, draws: int = DRAWS,
            seed: int = 0, progress: bool = True, also: Sequence[KVPipeline] = ()) -> Sensitivity:
    """Estimate every candidate's cost (see the module docstring) on calibration token ids `[N, T]`.

    Args:
        pipe: the pipeline to tune, for `model` (`pipe.for_model(model)`), calibrated where it needs to be.
        batch: sequences per forward pass; draws: label draws (backward passes) per batch; seed: of the labels.
        also: pipelines (for `model`) whose candidates are measured too, from the same gradients: the costs that
            measuring each alone on these windows would give, for one forward and backward pass per window.
    """
    started = time.perf_counter()
    config = model.config.get_text_config(decoder=True)
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = config_head_dim(config)
    options = layer_candidates(pipe, layers, kv_heads, head_dim, also)
    trials = [_trials(pipe, i, options[i]) for i in range(layers)]
    costs = [{side: [0.0] * len(c) for side, c in o.items()} for o in options]
    head_costs = [{side: [torch.zeros(kv_heads) for _ in c] for side, c in o.items()} for o in options]
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    positions = torch.arange(ids.shape[1], device=device)[None]
    requires = frozenset().union(*(p.layers_require for p in (pipe, *also)))  # what any candidate reads
    ropes = [arch.rope_fn(model, i)(positions) if {"cos", "sin"} & requires else None for i in range(layers)]
    exposed = exposed_pairs(pipe, ids.shape[1])
    if not exposed.any():
        least = pipe.sinks + pipe.residual + pipe.chunk
        raise ValueError(f"calibration windows of {ids.shape[1]} tokens store no token encoded (pipeline '{pipe.name}' "
                         f"keeps {pipe.sinks} sinks and a window of {pipe.residual} + {pipe.chunk} exact), so no width "
                         f"would cost anything: tune in windows of at least {least} tokens (--seq-len)")
    tokens = 0
    for window in tqdm(ids.split(batch), desc=f"tuning {pipe.name}", unit="batch", disable=not progress):
        probes: dict[int, Probe] = {}
        with _probed(model, probes), torch.enable_grad():
            grads = _sampled_gradients(model, window.to(device), probes, generator, draws, exposed)
        carry: dict = {}
        for i in range(layers):
            probe = probes.pop(i)
            inputs = {"queries": probe.query}
            if ropes[i] is not None:
                cos, sin = ropes[i]
                inputs.update(cos=cos.expand(window.shape[0], -1, -1), sin=sin.expand(window.shape[0], -1, -1))
            if probe.x is not None and "x" in requires:
                inputs["x"] = probe.x
            inputs.update({f"previous.{s}": t for s, t in carry.items()})
            carry = _layer_costs(pipe, i, probe, trials[i], grads[i], ids.shape[1], inputs, costs[i], head_costs[i])
        tokens += window.numel()
    costs, head_costs = ([{side: [c / tokens for c in cs] for side, cs in layer.items()} for layer in table]
                         for table in (costs, head_costs))
    return Sensitivity(pipe, options, costs, tokens, ids.shape[1], time.perf_counter() - started, head_costs,
                       tuple(also))
