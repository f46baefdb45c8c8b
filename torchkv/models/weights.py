"""The model's key/value projection weights, and pipelines specialized to one model (`KVPipeline.for_model`).

XQuant caches a function of the attention block's input X and rematerializes `K = X·W_k + b_k` and
`V = X·W_v + b_v`; its transforms derive their bases from these weights (no calibration data).
"""

import torch
from torch import nn

from torchkv import registry
from torchkv._compat import config_head_dim
from torchkv.models import arch
from torchkv.pipeline import KVPipeline
from torchkv.transforms import ProjectionWeights


def projection_weights(model: nn.Module) -> list[ProjectionWeights]:
    """Every layer's `K = X·k + k_bias`, `V = X·v + v_bias` before RoPE, as views of the model's weights.

    Key norms after the projection (Qwen3, Gemma 3, OLMo 2) are read as RMS norms (`key_norm`)."""
    config = model.config.get_text_config(decoder=True)
    kv_width = config.num_key_value_heads * config_head_dim(config)
    out = []
    for module in arch.attention_modules(model):
        norm = key_norm(module)
        if hasattr(module, "qkv_proj"):  # phi3: one fused projection, queries first
            weight = module.qkv_proj.weight
            q_width = weight.shape[0] - 2 * kv_width
            k, v = weight[q_width : q_width + kv_width], weight[q_width + kv_width :]
            out.append(ProjectionWeights(k.T, v.T))
            continue
        k_proj, v_proj = module.k_proj, module.v_proj
        out.append(ProjectionWeights(k_proj.weight.T, v_proj.weight.T, k_proj.bias, v_proj.bias, *norm))
    return out


def key_norm(module: nn.Module) -> tuple[torch.Tensor, float] | tuple[()]:
    """(scale s, eps) of an attention module's key norm, `k_norm(y) = y / sqrt(mean(y²) + eps) · s`, found by
    probing the module (Gemma's norms scale by `1 + weight`, the others by `weight`); () without a key norm."""
    norm = getattr(module, "k_norm", None)
    if norm is None:
        return ()
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if eps is None or weight is None or weight.dim() != 1:
        raise NotImplementedError(
            f"{type(module).__name__}.k_norm is a {type(norm).__name__}, not an RMS norm with a weight and an "
            "epsilon: methods that rematerialize keys from the layer input (XQuant) cannot rebuild its keys"
        )
    probe = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0), device=weight.device)
    with torch.no_grad():
        got = norm(probe.to(weight.dtype)).float()
        unit = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + eps)
        for scale in (weight, 1 + weight.float()):
            if torch.allclose(got, unit * scale.float(), rtol=2e-2, atol=1e-3):
                return scale, float(eps)
    raise NotImplementedError(
        f"{type(module).__name__}.k_norm ({type(norm).__name__}) is neither y·weight nor y·(1 + weight) after RMS "
        "normalization: methods that rematerialize keys from the layer input (XQuant) cannot rebuild its keys"
    )


@registry.register_delegate("for_model")
def specialize(pipe: KVPipeline, model: nn.Module) -> KVPipeline:
    """`pipe` for `model` (see `KVPipeline.for_model`): a new pipeline when an option is "auto" or a transform
    fits from weights, cached in `pipe` per model and window rules; `pipe` itself otherwise."""
    auto = sorted(k for k, v in pipe.options.items() if v == "auto")
    fits = any(t.fits_weights for _, chain in pipe.chains() for t in chain.transforms)
    if not auto and not fits:
        return pipe
    cached = pipe.specialized.setdefault(model, {})
    key = (*pipe.rules, pipe.compile)  # a copy with other rules (simulated quantization) gets its own
    if key in cached:
        return cached[key]
    config = pipe.config()
    if auto:
        preset = registry.preset(pipe.name)
        if preset.for_model is None:
            raise ValueError(f"preset '{pipe.name}' derives no options from the model; set {auto} explicitly")
        derived = preset.for_model(model.config.get_text_config(decoder=True))
        options = {**pipe.options, **{k: derived[k] for k in auto}}
        built = preset.build(**options).config()
        config.update(options=options, keys=built["keys"], values=built["values"], layers=built["layers"])
    out = KVPipeline.from_config(config)
    out.compile = pipe.compile
    out.load_params(pipe.params())
    out.fit_weights(projection_weights(model))
    cached[key] = out
    out.specialized[model] = {key: out}
    return out
