"""Which preset runs on which model family: every registered preset patched into a tiny random model of every
family in `torchkv.testing.TINY_ARCHITECTURES`, a left-padded batch of two prompts generated through it.

A cell either generates with every layer reading compressed tokens, or refuses with a message (today every cell
generates, and the matrix test requires it); the README's matrix is `support_markdown()`.
"""

import torch

from torchkv import registry
from torchkv.models.patch import patched
from torchkv.pipeline import KVPipeline

#: prompt tokens per row (longer than every preset's full-precision window plus one chunk, 128 + 128), the left
#: padding of the batch's first row, tokens generated, and the tiny models' sliding window (shorter than the prompt)
PROMPT, PAD, NEW_TOKENS, SLIDING_WINDOW = 400, 24, 4, 320

#: one preset of each recipe (the others differ from it in bits and options only): the matrix `make test` runs
REPRESENTATIVES = ("fp16", "kivi-2bit", "squat-2bit", "squat-pre-2bit", "subkv-2bit", "svdq-1.25bit-v4",
                   "svdq-1.25bit-sparse", "xquant-2bit", "xquant-cl-2bit", "aquakv-2bit", "frontier-2.5bit")


def tiny_family_model(model_type: str) -> torch.nn.Module:
    """The matrix's tiny model of a family: 4 query heads, 2 KV heads of 64 channels (the narrowest of the real
    families), 2 layers; a 320-token window where the family slides one."""
    from torchkv.testing import TINY_ARCHITECTURES, tiny_model

    overrides = {"sliding_window": SLIDING_WINDOW} if "sliding_window" in TINY_ARCHITECTURES[model_type][1] else {}
    return tiny_model(model_type, head_dim=64, **overrides)


def _pipeline(preset: str, model: torch.nn.Module, ids: torch.Tensor) -> KVPipeline:
    pipe = KVPipeline.from_preset(preset, compile=False)
    if pipe.needs_fit:
        pipe.fit(model, ids, seq_len=ids.shape[1], batch=ids.shape[0], progress=False)
    return pipe


def run_cell(preset: str, model_type: str) -> str | None:
    """Generate through `preset` on the family's tiny model: None when it ran with compressed tokens read in
    every layer, else the refusal's message (`NotImplementedError` or `ValueError`); a cell that runs but reads no
    compressed token or gives non-finite logits raises `RuntimeError` (other errors propagate)."""
    model = tiny_family_model(model_type)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    try:
        pipe = _pipeline(preset, model, ids)
        with patched(model, pipe):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    except (NotImplementedError, ValueError) as err:
        return str(err)
    cache = out.past_key_values
    encoded = [min(store.n_encoded for store in layer.stores()) for layer in cache.layers]  # (row groups: each)
    if not all(n > 0 for n in encoded):
        raise RuntimeError(f"{preset} on {model_type}: a layer read no compressed token (tokens encoded: {encoded})")
    if not all(torch.isfinite(s).all() for s in out.scores):
        raise RuntimeError(f"{preset} on {model_type}: non-finite logits")
    return None


def support_matrix(presets: list[str] | None = None, model_types: list[str] | None = None) -> dict:
    """{preset: {model type: None (runs) or the refusal's message}} over registered presets and tiny families."""
    from torchkv.testing import TINY_ARCHITECTURES

    presets = presets or registry.preset_names()
    model_types = model_types or list(TINY_ARCHITECTURES)
    return {p: {m: run_cell(p, m) for m in model_types} for p in presets}


def support_markdown(matrix: dict | None = None) -> str:
    """The README's matrix: ✓ where a preset runs on a family, else ✗ with a footnote giving the reason."""
    matrix = matrix or support_matrix()
    families = list(next(iter(matrix.values())))
    lines = [f"| preset | {' | '.join(families)} |", "|---" * (len(families) + 1) + "|"]
    reasons: list[str] = []
    for preset, row in matrix.items():
        cells = []
        for message in row.values():
            if message is None:
                cells.append("✓")
                continue
            if message not in reasons:
                reasons.append(message)
            cells.append(f"✗ [{reasons.index(message) + 1}]")
        lines.append(f"| {preset} | {' | '.join(cells)} |")
    if reasons:
        lines += ["", *[f"[{i + 1}] {m}" for i, m in enumerate(reasons)]]
    return "\n".join(lines)
