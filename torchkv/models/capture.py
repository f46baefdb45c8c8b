"""One unpatched forward pass that records what every layer's attention sees."""

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from torchkv.models.arch import attention_input, attention_modules

CAPTURE_NAME = "torchkv_capture"


@torch.no_grad()
def capture_qkv(
    model, input_ids: torch.Tensor, layer_inputs: bool = False
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    """Run a causal, unpadded prompt once and record each layer's attention inputs.

    Args:
        model: an unpatched HF causal LM (its attention implementation is restored afterwards).
        input_ids: [B, T] token ids, no padding.
        layer_inputs: also record each attention block's input X (what XQuant caches).

    Returns:
        logits: [B, V] of the last position.
        layers: per layer `(q, k, v)`: post-RoPE queries `[B, Hq, T, D]`, keys and values `[B, H, T, D]`;
            `(q, k, v, x)` with `layer_inputs`, x `[B, T, d]`.
    """
    records, inputs = {}, {}

    def record_input(module, args, kwargs):
        inputs[module.layer_idx] = attention_input(args, kwargs)

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        records[module.layer_idx] = (query, key, value)
        gqa = query.shape[1] != key.shape[1]
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(CAPTURE_NAME, capture)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    hooks = [m.register_forward_pre_hook(record_input, with_kwargs=True)
             for m in (attention_modules(model) if layer_inputs else [])]
    try:
        logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits[:, -1]
    finally:
        model.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()
    if layer_inputs:
        return logits, [(*records[i], inputs[i]) for i in sorted(records)]
    return logits, [records[i] for i in sorted(records)]
