"""Scoring and generation whose every predicted token reads a compressed cache.

A request's context is prefilled into a fresh cache of the row, all but its last token; a second forward pass
then feeds that last token (or the question asked after the context) and the continuation, so the continuation's
first token is predicted from the stored, compressed context too. A single forward pass over context and
continuation would read no stored token at all, and every cache would score as full precision.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from torchkv.eval.rows import Method
from torchkv.models import cache_argument


@dataclass(frozen=True)
class Request:
    """Token ids of one scored request."""

    cached: tuple[int, ...]  # prefilled into the row's cache
    continuation: tuple[int, ...]  # scored; each token is predicted by a forward pass that reads the cache
    asked: tuple[int, ...] = ()  # fed after the cache is filled and not scored (a question asked after the context)

    def __post_init__(self):
        if not self.continuation:
            raise ValueError("a scored request needs a non-empty continuation (the tokens whose log-likelihood "
                             "is asked for)")
        if not self.cached:
            raise ValueError("a scored request needs a non-empty context to prefill into the cache")

    def split(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prefill, fed): what goes into the cache first, and what the scoring pass feeds before the continuation."""
        if self.asked:
            return self.cached, self.asked
        return self.cached[:-1], self.cached[-1:]


@dataclass(frozen=True)
class Scored:
    logprob: float  # sum of the continuation's token log-probabilities
    greedy: bool  # every continuation token is the argmax: greedy decoding would produce the continuation


def _left_padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, each [B, max length], padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids, mask


def _right_padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def _forward(model, ids: torch.Tensor, mask: torch.Tensor, past: torch.Tensor, cache, last_only: bool):
    """Logits of `ids` [B, S] after `past` [B, P] (the mask of what the cache holds): [B, S or 1, V]."""
    full = torch.cat([past, mask], dim=1)
    positions = (full.cumsum(1) - 1).clamp(min=0)[:, past.shape[1]:]
    device = model.device
    out = model(input_ids=ids.to(device), attention_mask=full.to(device), position_ids=positions.to(device),
                **cache_argument(model, cache), use_cache=True, logits_to_keep=1 if last_only else 0)
    return out.logits


def _pad_id(model) -> int:
    config = model.config.get_text_config(decoder=True)
    for pad in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None), 0):
        if isinstance(pad, list):
            pad = pad[0] if pad else None
        if pad is not None:
            return int(pad)
    return 0


def _prefilled(model, row: Method, prefills: Sequence[Sequence[int]]):
    """(cache, mask [B, P] of its tokens): a fresh cache of `row` holding the left-padded `prefills`."""
    cache = row.new_cache(model)
    ids, mask = _left_padded(prefills, _pad_id(model))
    if ids.shape[1]:
        _forward(model, ids, mask, mask[:, :0], cache, last_only=True)
    return cache, mask


def _batches(order: list[int], batch_size: int, empty_prefill) -> list[list[int]]:
    """Indices in batches of up to `batch_size`; a request with nothing to prefill runs alone (a padded row
    with no real token would attend to nothing)."""
    alone = [[i] for i in order if empty_prefill(i)]
    rest = [i for i in order if not empty_prefill(i)]
    return alone + [rest[k : k + batch_size] for k in range(0, len(rest), batch_size)]


@torch.no_grad()
def score(model, row: Method, requests: Sequence[Request], batch_size: int = 1,
          progress: bool = False) -> list[Scored]:
    """Log-likelihood of each request's continuation after its context, read through `row`'s cache.

    Each batch (longest requests first, contexts left-padded, continuations right-padded) fills one fresh cache
    with its requests' contexts (the last token held back, or all of it when a question is asked), then one
    forward pass over `fed + continuation[:-1]` predicts every continuation token from that cache.
    """
    order = sorted(range(len(requests)), key=lambda i: -(len(requests[i].cached) + len(requests[i].continuation)))
    out: list[Scored | None] = [None] * len(requests)
    batches = _batches(order, max(1, batch_size), lambda i: not requests[i].split()[0])
    with row.active(model), tqdm(total=len(requests), desc=f"score {row.name}", disable=not progress,
                                 leave=False) as bar:
        for batch in batches:
            splits = [requests[i].split() for i in batch]
            cache, past = _prefilled(model, row, [prefill for prefill, _ in splits])
            scored = [fed + requests[i].continuation[:-1] for i, (_, fed) in zip(batch, splits)]
            ids, mask = _right_padded(scored, _pad_id(model))
            logprobs = _forward(model, ids, mask, past, cache, last_only=False).float().log_softmax(-1).cpu()
            for b, (i, (_, fed)) in enumerate(zip(batch, splits)):
                target = torch.tensor(requests[i].continuation)
                rows = logprobs[b, len(fed) - 1 : len(fed) - 1 + target.numel()]
                out[i] = Scored(float(rows.gather(1, target[:, None]).sum()), bool(torch.equal(rows.argmax(-1), target)))
            bar.update(len(batch))
    return out


def _cut(text: str, until: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string."""
    ends = [text.find(stop) for stop in until if stop and stop in text]
    return text[: min(ends)] if ends else text


@torch.no_grad()
def generate(model, tokenizer, row: Method, contexts: Sequence[Sequence[int]], max_new_tokens: int,
             until: Sequence[str] = (), batch_size: int = 1, progress: bool = False, **generate_kwargs) -> list[str]:
    """Text generated after each context (greedy unless `generate_kwargs` say otherwise), cut at the first stop
    string. Every context but its last token is prefilled into `row`'s cache first, so the first new token is
    predicted from the stored context too; `model.generate` then continues on that cache."""
    if any(len(c) < 2 for c in contexts):
        raise ValueError("each context needs at least 2 tokens: all but the last are prefilled into the cache")
    order = sorted(range(len(contexts)), key=lambda i: -len(contexts[i]))
    out: list[str | None] = [None] * len(contexts)
    pad = _pad_id(model)
    kwargs = {"do_sample": False, "pad_token_id": pad, **generate_kwargs}
    if until:
        kwargs.update(stop_strings=list(until), tokenizer=tokenizer)
    with row.active(model), tqdm(total=len(contexts), desc=f"generate {row.name}", disable=not progress,
                                 leave=False) as bar:
        for k in range(0, len(order), max(1, batch_size)):
            batch = order[k : k + max(1, batch_size)]
            cache, _ = _prefilled(model, row, [contexts[i][:-1] for i in batch])
            ids, mask = _left_padded([contexts[i] for i in batch], pad)
            new = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                 **cache_argument(model, cache), max_new_tokens=max_new_tokens,
                                 **kwargs)[:, ids.shape[1]:]
            for b, i in enumerate(batch):
                out[i] = _cut(tokenizer.decode(new[b], skip_special_tokens=True), until)
            bar.update(len(batch))
    return out


@torch.no_grad()
def rolling_logprob(model, row: Method, ids: Sequence[int], block: int = 64, window: int | None = None) -> float:
    """Sum of log p(ids[t] | ids[:t]) over t ≥ 1, the text streamed in blocks of `block` tokens through `row`'s
    cache (the project's streaming perplexity). Texts longer than `window` positions (default: the model's) are
    cut into windows overlapping by one token, each through a fresh cache."""
    window = window or model.config.get_text_config(decoder=True).max_position_embeddings
    ids = torch.tensor(ids, dtype=torch.long)
    total = 0.0
    with row.active(model):
        for start in range(0, max(1, ids.numel() - 1), window - 1):
            part = ids[start : start + window]
            cache = row.new_cache(model)
            for b in range(0, part.numel() - 1, block):
                chunk = part[None, b : b + block]
                logits = model(input_ids=chunk.to(model.device), **cache_argument(model, cache),
                               use_cache=True).logits[0].float().log_softmax(-1).cpu()
                targets = part[b + 1 : b + 1 + block]
                total += float(logits[: targets.numel()].gather(1, targets[:, None]).sum())
    return total
