"""One unpatched forward pass that records what every layer's attention sees."""

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

CAPTURE_NAME = "torchkv_capture"


@torch.no_grad()
def capture_qkv(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    """Run a causal, unpadded prompt once and record each layer's attention inputs.

    Args:
        model: an unpatched HF causal LM (its attention implementation is restored afterwards).
        input_ids: [B, T] token ids, no padding.

    Returns:
        logits: [B, V] of the last position.
        layers: per layer `(q, k, v)`: post-RoPE queries `[B, Hq, T, D]`, keys and values `[B, H, T, D]`.
    """
    records = {}

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        records[module.layer_idx] = (query, key, value)
        gqa = query.shape[1] != key.shape[1]
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(CAPTURE_NAME, capture)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    try:
        logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits[:, -1]
    finally:
        model.set_attn_implementation(previous)
    return logits, [records[i] for i in sorted(records)]
