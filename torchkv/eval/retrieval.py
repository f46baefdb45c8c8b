"""Retrieval: a 5-digit pass key stated once early in a long context of held-out text, asked for at the end."""

import random
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from torchkv.corpora import DEFAULT_DOMAIN, token_stream
from torchkv.eval.rows import Method
from torchkv.models import cache_argument
from torchkv.models.capture import capture_qkv

_INTRO = "Remember the pass key. The pass key is {key}.\n\n"
_QUESTION = "\n\nQuestion: What is the pass key?\nAnswer: The pass key is"


@dataclass(frozen=True)
class Case:
    key: str
    prompt: torch.Tensor  # [1, context] token ids
    answer: torch.Tensor  # [n] token ids of " {key}"


def cases(tokenizer, context: int, count: int, seed: int = 0, domain_name: str = DEFAULT_DOMAIN) -> list[Case]:
    """`count` seeded cases of `context` tokens: the key sentence opens the context, then a random
    stretch of `domain_name`'s held-out text, then the question."""
    rng = random.Random(f"{seed}-{context}")
    stream = token_stream(tokenizer, "eval", domain_name)
    question = tokenizer(_QUESTION, add_special_tokens=False, return_tensors="pt").input_ids[0]
    out = []
    for _ in range(count):
        key = str(rng.randint(10000, 99999))
        intro = tokenizer(_INTRO.format(key=key), add_special_tokens=False, return_tensors="pt").input_ids[0]
        filler_len = context - intro.numel() - question.numel()
        start = rng.randint(0, stream.numel() - filler_len)
        filler = stream[start : start + filler_len]
        ids = torch.cat([intro, filler, question])
        answer = tokenizer(" " + key, add_special_tokens=False, return_tensors="pt").input_ids[0]
        out.append(Case(key, ids[None], answer))
    return out


@torch.no_grad()
def retrieval(model, case_list: list[Case], methods: list[Method], progress: bool = True) -> dict[str, dict]:
    """Exact match and mean log-probability of the true key for every row, by teacher forcing.

    Each case's prompt runs once, unpatched: prompt attention is full precision in every cache (a cache
    compresses only what it stores), so one pass serves every row. Each row's cache is filled with that
    pass's queries, keys and values through its own update path, then the key's tokens are fed through
    the row's cache. Greedy decoding reproduces the key exactly when each of its tokens is the argmax.

    Returns:
        row name -> {"accuracy", "logprob", "cases"}.
    """
    hits, logprob = {m.name: 0 for m in methods}, {m.name: 0.0 for m in methods}
    layer_inputs = any(m.reads_layer_input(model) for m in methods)
    for case in tqdm(case_list, desc=f"retrieval {case_list[0].prompt.shape[1]}", disable=not progress, leave=False):
        last, layers = capture_qkv(model, case.prompt, layer_inputs)
        for method in methods:
            cache = method.filled_cache(model, layers)
            with method.active(model):
                rest = model(input_ids=case.answer[None, :-1], **cache_argument(model, cache), use_cache=True).logits[0]
            logits = torch.cat([last, rest]).float().log_softmax(-1)
            logprob[method.name] += float(logits.gather(1, case.answer[:, None]).sum())
            hits[method.name] += bool(torch.equal(logits.argmax(-1), case.answer))
    n = len(case_list)
    return {m.name: {"accuracy": hits[m.name] / n, "logprob": logprob[m.name] / n, "cases": n} for m in methods}
