"""Perplexity measured through the cache: text fed in blocks, each block reading the (compressed) history."""

import math

import torch
from tqdm.auto import tqdm

from torchkv.eval.rows import Method
from torchkv.models import cache_argument


@torch.no_grad()
def perplexity(model, docs: torch.Tensor, method: Method, block: int = 64, simulated: bool = False,
               progress: bool = True, prompt: int = 0) -> float:
    """exp(mean next-token NLL) over `docs`, each fed in blocks of `block` tokens through a fresh cache.

    Args:
        docs: [N, L] token ids.
        simulated: store every token before any query reads it (papers' "simulated quantization").
        prompt: the first `prompt` tokens of each document go in as one block (a prompt the cache
            compresses at prefill, as SVDq's does), and only the tokens after it are scored.

    Returns:
        perplexity over the N·(L-1-prompt) predicted tokens (N·(L-1) without a prompt).
    """
    nll, count = 0.0, 0
    steps = docs.shape[0] * (math.ceil((docs.shape[1] - prompt) / block) + bool(prompt))
    mode = "simulated" if simulated else "streaming"
    with method.active(model), tqdm(total=steps, desc=f"ppl {method.name} {docs.shape[1]} {mode}",
                                    disable=not progress, leave=False) as bar:
        for doc in docs:
            cache = method.new_cache(model, simulated=simulated)
            starts = ([0] if prompt else []) + list(range(prompt, doc.numel(), block))
            for start, end in zip(starts, [*starts[1:], doc.numel()]):
                ids = doc[None, start:end]
                logits = model(input_ids=ids, **cache_argument(model, cache), use_cache=True).logits[0].float()
                targets = doc[start + 1 : end + 1]
                logits = logits[: targets.numel()]
                if start >= prompt:  # the prompt's own predictions are prefill's, lossless in every cache
                    nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
                    count += targets.numel()
                bar.update()
    return math.exp(nll / count)
