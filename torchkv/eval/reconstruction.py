"""A preset applied to a captured prompt's real keys and values, and the logit error later queries see."""

from collections.abc import Iterator

import torch

import torchkv.transforms as T
from torchkv.models.arch import rope_fn
from torchkv.pipeline import KVPipeline


@torch.no_grad()
def reconstruct_prompt(
    pipe: KVPipeline, model, layers: list[tuple[torch.Tensor, ...]], prompt: int
) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]]:
    """Encode and decode the first `prompt` tokens of every captured layer (`models.capture.capture_qkv`).

    Each layer prepares on the prompt's own queries (and rotary embedding, for pre-RoPE presets); pipelines
    that read the layer input (XQuant) need layers captured with `layer_inputs=True`.

    Yields:
        per layer: the encoded state, and the reconstructed keys and values `[B, H, prompt, D]`.
    """
    previous: dict[str, torch.Tensor] = {}  # cross-layer pipelines: the previous layer's reconstruction
    pipe = pipe.for_model(model)
    for i, (q, k, v, *x) in enumerate(layers):
        layer_pipe = pipe.for_layer(i)
        k, v = k[:, :, :prompt], v[:, :, :prompt]
        inputs = {"queries": q[:, :, :prompt]}
        if "x" in layer_pipe.requires:
            if not x:
                raise ValueError(f"pipeline '{pipe.name}' reads the layer input: capture with capture_qkv(..., "
                                 "layer_inputs=True)")
            inputs["x"] = x[0][:, :prompt]
        if "cos" in layer_pipe.requires:
            inputs["cos"], inputs["sin"] = rope_fn(model, i)(torch.arange(prompt, device=k.device)[None])
        prepared = layer_pipe.prepare(k, v, layer=i, inputs=inputs) if layer_pipe.needs_prepare else {}
        state = layer_pipe.encode_chunk(k, v, layer=i, prepared=prepared, inputs={**inputs, **previous})
        state = {n: t for n, t in state.items() if not n.startswith("carry.")}
        k_hat, v_hat, *carry = layer_pipe.decode_chunk(state, head_dim=k.shape[-1], layer=i, prepared=prepared,
                                                       inputs={**inputs, **previous})
        previous = {f"previous.{side}": t for side, t in (carry[0] if carry else {}).items()}
        yield state, k_hat, v_hat


def held_out_logit_error(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor) -> float:
    """Mean |q·(k̂ - k)| of later queries against reconstructed keys (SQuat's target, Theorem 1).

    Args:
        q: [B, Hq, T', D] queries of tokens after the keys' (query head i reads KV head i // (Hq/H)).
        k, k_hat: [B, H, T, D] keys and their reconstruction.
    """
    b, h, _, d = k.shape
    rows = q.reshape(b, h, -1, d)  # [B, H, n_rep·T', D], the query heads of each KV head stacked
    return float((rows.float() @ (k_hat - k).float().transpose(-1, -2)).abs().mean())


def key_rel_error(pipe: KVPipeline, model, layers: list[tuple[torch.Tensor, ...]], prompt: int) -> float:
    """‖k̂ - k‖ / ‖k‖ over every layer's first `prompt` keys (post-RoPE; RoPE preserves the error norm)."""
    err = norm = 0.0
    for (_, k, _), (_, k_hat, _) in zip(layers, reconstruct_prompt(pipe, model, layers, prompt)):
        k = k[:, :, :prompt]
        err += float((k_hat - k).double().pow(2).sum())
        norm += float(k.double().pow(2).sum())
    return (err / norm) ** 0.5


def per_channel_keys(bits: int, group: int) -> KVPipeline:
    """SVDq's baseline: pre-RoPE keys quantized per channel in the original space, ranges over `group`
    tokens (values kept exactly)."""
    return KVPipeline([T.rotate("pre_rope"), T.quantize(bits=bits, axis="channel", group=group), T.pack()],
                      [T.quantize("cast", dtype="float32")], residual=0)
