"""Retrieval: a 5-digit pass key stated once early in a long Wikipedia context, asked for at the end."""

import random
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from torchkv.eval.data import token_stream
from torchkv.eval.rows import Method

_INTRO = "Remember the pass key. The pass key is {key}.\n\n"
_QUESTION = "\n\nQuestion: What is the pass key?\nAnswer: The pass key is"


@dataclass(frozen=True)
class Case:
    key: str
    prompt: torch.Tensor  # [1, context] token ids
    answer: torch.Tensor  # [n] token ids of " {key}"


def cases(tokenizer, context: int, count: int, seed: int = 0) -> list[Case]:
    """`count` seeded cases of `context` tokens: the key sentence opens the context, then a random
    stretch of held-out Wikipedia text, then the question."""
    rng = random.Random(f"{seed}-{context}")
    stream = token_stream(tokenizer, "eval")
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
def retrieval(model, case_list: list[Case], method: Method, progress: bool = True) -> dict[str, float]:
    """Exact match and mean log-probability of the true key, by teacher forcing through the cache.

    The prompt is prefilled into a fresh cache and the key's tokens are fed after it: greedy decoding
    reproduces the key exactly when every one of its tokens is the argmax given the ones before.
    """
    hits, logprob = 0, 0.0
    with method.active(model):
        for case in tqdm(case_list, desc=f"retrieval {method.name} {case_list[0].prompt.shape[1]}",
                         disable=not progress, leave=False):
            cache = method.new_cache(model)
            last = model(input_ids=case.prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0]
            rest = model(input_ids=case.answer[None, :-1], past_key_values=cache, use_cache=True).logits[0]
            logits = torch.cat([last, rest]).float().log_softmax(-1)
            picked = logits.gather(1, case.answer[:, None])[:, 0]
            logprob += float(picked.sum())
            hits += bool(torch.equal(logits.argmax(-1), case.answer))
    n = len(case_list)
    return {"accuracy": hits / n, "logprob": logprob / n, "cases": n}
