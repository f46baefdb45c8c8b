"""Synthetic long-context tasks over the held-out Wikipedia text: RULER-style retrieval and aggregation, a
needle at a chosen depth, next-sentence cloze and long-document QA.

Every generator is pure: the same arguments give the same sample. RULER samples are cut to the token budget
of the tokenizer passed in; the filler ("haystack") is the 'eval' split of a `torchkv.corpora` domain (Wikipedia
unless another is named). Keys and word lists come from the Wikipedia vocabulary in every domain, so a seed draws the
same needles whatever the haystack.
"""

import bisect
import functools
import itertools
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from torchkv.corpora import DEFAULT_DOMAIN, split_articles, split_text, token_stream

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words")
MIN_FILLER = 64  # tokens of haystack (or word list) a sample needs beyond its needles, question and answer
_SNAP = 0.04  # a needle moves at most this fraction of the context to reach a sentence boundary
_BOUNDARY = re.compile(r"[.!?]\s+|\n\n")
_SENTENCE = re.compile(r"\S.*?[.!?](?=\s+[A-Z0-9\"'(]|\s*$)", re.DOTALL)


@dataclass(frozen=True)
class Sample:
    """One prompt: `context` goes into the KV cache, then `question`; `target` is its expected continuation."""

    task: str
    context: str  # the haystack with the needles inserted
    question: str  # starts with "\n\n", ends with the answer's lead-in ("Answer: The ... is"), where the answer starts
    answers: tuple[str, ...]  # every expected string
    target: str  # the continuation scored by log-likelihood; begins with a space
    depth: float | None = None  # where the generator placed the (first) needle, as a fraction of the context
    length: int = 0  # the token budget this sample was built for


def score(sample: Sample, output: str) -> float:
    """String-match recall: the fraction of `sample.answers` found in `output`, ignoring case."""
    found = output.lower()
    return sum(answer.lower() in found for answer in sample.answers) / len(sample.answers)


@functools.cache
def vocabulary() -> tuple[str, ...]:
    """The distinct lowercase alphabetic words (3-10 letters) of the 'eval' split, sorted."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{3,10}\b", split_text("eval")))))


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _haystack(tokenizer, start: int, n: int, domain_name: str) -> str:
    """About `n` tokens of `domain_name`'s 'eval' split from token `start`, beginning at a sentence start."""
    text = tokenizer.decode(token_stream(tokenizer, "eval", domain_name)[start : start + n])
    first = _BOUNDARY.search(text[:400])
    return text[first.end() :] if first else text


def _insert(haystack: str, needles: list[str], depths: list[float]) -> str:
    """`haystack` with `needles` (in order) starting near fractions `depths` (sorted) of the result, moved to the
    nearest sentence boundary when one is within `_SNAP` of the context, else to the nearest word boundary."""
    total = len(haystack) + sum(len(n) + 1 for n in needles)
    sentence_ends = sorted({0, len(haystack), *(m.end() for m in _BOUNDARY.finditer(haystack))})
    word_ends = sorted({0, len(haystack), *(m.end() for m in re.finditer(r"\s+", haystack))})
    positions, before = [], 0
    for needle, depth in zip(needles, depths):
        goal = min(max(round(depth * total) - before, 0), len(haystack))
        nearest = _nearest(sentence_ends, goal)
        positions.append(nearest if abs(nearest - goal) <= _SNAP * total else _nearest(word_ends, goal))
        before += len(needle) + 1
    text = haystack
    for position, _, needle in sorted(zip(positions, range(len(needles)), needles), reverse=True):
        left, right = text[:position], text[position:]
        text = left + ("" if not left or left[-1].isspace() else " ") + needle + ("" if right[:1].isspace() else " ") + right
    return text.rstrip(" ")


def _nearest(sorted_values: list[int], goal: int) -> int:
    i = bisect.bisect_left(sorted_values, goal)
    return min(sorted_values[max(i - 1, 0) : i + 1], key=lambda v: abs(v - goal))


def _fit(tokenizer, length: int, task: str, build: Callable[[int], Sample], per_unit: float = 1.0) -> Sample:
    """The sample `build(n)` whose tokens fall in [0.98 * length, length], searching the filler size `n`
    (first guess: each unit of `n` adds `per_unit` tokens)."""
    low = math.ceil(0.98 * length)
    empty = build(0)
    overhead = _count(tokenizer, empty.context + empty.question + empty.target)
    if length < overhead + MIN_FILLER:
        raise ValueError(
            f"length {length} is too small for '{task}': its needles, question and answer alone take {overhead} "
            f"tokens; use length >= {overhead + MIN_FILLER}"
        )
    goal = (low + length) // 2
    points = [(0, overhead)]
    n = max(1, round((goal - overhead) / per_unit))
    for _ in range(30):
        sample = build(n)
        tokens = _count(tokenizer, sample.context + sample.question + sample.target)
        if low <= tokens <= length:
            return sample
        points.append((n, tokens))
        (n0, t0), (n1, t1) = points[-2], points[-1]
        rate = (t1 - t0) / (n1 - n0) if n1 != n0 and t1 != t0 else 1.0
        step = round((goal - tokens) / max(rate, 0.1))
        n = max(1, n + (step or (1 if tokens < low else -1)))
    raise RuntimeError(f"could not fit '{task}' into {length} tokens; report this with the tokenizer used")


def _needle(key: str, number: int) -> str:
    return f"The special magic number for {key} is: {number}."


def _key(rng: random.Random) -> str:
    return "-".join(rng.sample(vocabulary(), 2))


def ruler_sample(task: str, tokenizer, length: int, seed: int, domain_name: str = DEFAULT_DOMAIN) -> Sample:
    """A RULER-style sample of `task` (one of `RULER_TASKS`) whose context + question + target tokenize
    (without special tokens) to between 0.98 * `length` and `length` tokens, in a haystack of `domain_name`."""
    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER task '{task}'; available: {', '.join(RULER_TASKS)}")
    rng = random.Random(f"{task}-{length}-{seed}")
    if task == "common_words":
        return _fit(tokenizer, length, task, _common_words(rng, length), per_unit=2.5)
    start = _haystack_start(rng, tokenizer, length, domain_name)
    if task == "variable_tracking":
        needles, question, answers, target = _variables(rng)
    else:
        needles, question, answers, target = _magic_numbers(task, rng)
    depths = sorted(rng.random() for _ in needles)
    if task == "variable_tracking":  # keep each chain in order while interleaving the two chains
        needles = _interleave(rng, needles[: len(needles) // 2], needles[len(needles) // 2 :])

    def build(n: int) -> Sample:
        context = _insert(_haystack(tokenizer, start, n, domain_name), needles, depths)
        return Sample(task, context, question, answers, target, depths[0], length)

    return _fit(tokenizer, length, task, build)


def _magic_numbers(task: str, rng: random.Random) -> tuple[list[str], str, tuple[str, ...], str]:
    numbers = rng.sample(range(1_000_000, 10_000_000), 1 if task == "niah_single" else 4)
    keys = [_key(rng)] * len(numbers) if task == "niah_multivalue" else [_key(rng) for _ in numbers]
    needles = [_needle(k, v) for k, v in zip(keys, numbers)]
    if task == "niah_multivalue":
        question = (f"\n\nList every special magic number for {keys[0]} given in the text above, in the order they "
                    f"appear, separated by commas.\nAnswer: The special magic numbers for {keys[0]} are")
        answers = tuple(str(v) for v in numbers)
        return needles, question, answers, " " + ", ".join(answers)
    asked = rng.randrange(len(numbers))
    rng.shuffle(order := list(range(len(numbers))))
    needles = [needles[i] for i in order]
    question = (f"\n\nWhat is the special magic number for {keys[asked]} given in the text above?\nAnswer: The "
                f"special magic number for {keys[asked]} is")
    return needles, question, (str(numbers[asked]),), f" {numbers[asked]}"


def _variables(rng: random.Random, hops: int = 4) -> tuple[list[str], str, tuple[str, ...], str]:
    names = set()
    while len(names) < 2 * (hops + 1):
        names.add("".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)))
    names = rng.sample(sorted(names), len(names))
    values = rng.sample(range(10_000, 100_000), 2)
    needles = []
    for chain, value in zip((names[: hops + 1], names[hops + 1 :]), values):
        needles.append(f"VAR {chain[0]} = {value}.")
        needles += [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(chain)]
    answers = tuple(names[: hops + 1])
    question = (f"\n\nFind every variable that is assigned the value {values[0]}, directly or through other "
                "variables, in the text above. List them separated by commas.\nAnswer: The variables assigned the "
                f"value {values[0]} are")
    return needles, question, answers, " " + ", ".join(answers)


def _interleave(rng: random.Random, first: list[str], second: list[str]) -> list[str]:
    slots = sorted(rng.sample(range(len(first) + len(second)), len(first)))
    a, b = iter(first), iter(second)
    return [next(a) if i in slots else next(b) for i in range(len(first) + len(second))]


def _common_words(rng: random.Random, length: int, common: int = 10) -> Callable[[int], Sample]:
    """A builder of word lists where `common` words repeat (3 to 30 times, growing with `length`) and `n` others
    occur once."""
    repeats = min(max(length // 128, 3), 30)
    words = rng.sample(vocabulary(), len(vocabulary()))
    frequent, rare = words[:common], words[common:]
    shuffle_seed = rng.random()
    question = ("\n\nWhich 10 words appear most often in the list above? Give them separated by commas."
                "\nAnswer: The 10 most common words are")

    def build(n: int) -> Sample:
        if n > len(rare):
            raise ValueError(f"length {length} needs more distinct words than the 'eval' split has; use a shorter one")
        listed = frequent * repeats + rare[:n]
        random.Random(f"{shuffle_seed}-{n}").shuffle(listed)
        order = sorted(frequent, key=listed.index)
        context = "Here is a list of words: " + ", ".join(listed) + "."
        return Sample("common_words", context, question, tuple(order), " " + ", ".join(order), None, length)

    return build


def _haystack_start(rng: random.Random, tokenizer, length: int, domain_name: str) -> int:
    """A random first token of a `length`-token haystack in `domain_name`'s 'eval' split."""
    stream = token_stream(tokenizer, "eval", domain_name).numel()
    if length + 1 > stream:
        raise ValueError(f"length {length} is longer than the '{domain_name}' domain's 'eval' split ({stream} tokens); "
                         "use a shorter one")
    return rng.randrange(stream - length)


def needle_sample(tokenizer, length: int, depth: float, seed: int, domain_name: str = DEFAULT_DOMAIN) -> Sample:
    """One needle (a 7-digit number keyed by a random word pair) at fractional `depth` of the context
    (0 = first, 1 = just before the question), in a haystack of `domain_name` filling 0.98 * `length` to `length`
    tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"needle-{length}-{depth}-{seed}")
    start = _haystack_start(rng, tokenizer, length, domain_name)
    key, number = _key(rng), rng.randrange(1_000_000, 10_000_000)
    question = (f"\n\nWhat is the special magic number for {key} given in the text above?\nAnswer: The special "
                f"magic number for {key} is")

    def build(n: int) -> Sample:
        context = _insert(_haystack(tokenizer, start, n, domain_name), [_needle(key, number)], [depth])
        return Sample("needle", context, question, (str(number),), f" {number}", depth, length)

    return _fit(tokenizer, length, "needle", build)


def _measure(tokenizer) -> Callable[[str], int]:
    """Token count with `tokenizer`, or an estimate of 4 tokens per 3 words without one."""
    if tokenizer is None:
        return lambda text: math.ceil(len(text.split()) * 4 / 3)
    return lambda text: _count(tokenizer, text)


@functools.cache
def _sentences() -> tuple[tuple[tuple[int, int], ...], ...]:
    """(start, end) character spans of the sentences of each 'eval' article, in `split_text("eval")` offsets."""
    spans, offset = [], 0
    for _, text in split_articles("eval"):
        spans.append(tuple((offset + m.start(), offset + m.end()) for m in _SENTENCE.finditer(text)))
        offset += len(text) + 2  # the blank line that joins articles
    return tuple(spans)


def _usable(span: tuple[int, int]) -> bool:
    return 30 <= span[1] - span[0] <= 300


def wiki_cloze(count: int, tokenizer=None, context_tokens: int = 1000, seed: int = 0) -> list[dict]:
    """Next-sentence multiple choice: `context` is ~`context_tokens` tokens of consecutive 'eval' text (from a
    sentence start to a sentence end), `choices` the true next sentence (same article) and 3 sentences of other
    articles, `gold` the index of the true one. Tokens are counted with `tokenizer`, or estimated from words."""
    text, spans, measure = split_text("eval"), _sentences(), _measure(tokenizer)
    starts = sorted(start for article in spans for start, _ in article)
    bodies = [(a, s) for a, article in enumerate(spans) for s in article[1:] if _usable(s)]
    rng = random.Random(f"wiki_cloze-{context_tokens}-{seed}")
    docs = []
    while len(docs) < count:
        article, (end, stop) = rng.choice(bodies)
        # the latest sentence start that still gives `context_tokens` tokens (binary search; fewer if at the start)
        lo, hi = 0, bisect.bisect_left(starts, end) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if measure(text[starts[mid] : end]) >= context_tokens else (lo, mid - 1)
        context = text[starts[lo] : end].rstrip()
        others = [s for a, s in rng.sample(bodies, 12) if a != article][:3]
        choices = [text[a:b] for a, b in others]
        gold = rng.randrange(4)
        choices.insert(gold, text[end:stop])
        docs.append({"context": context, "choices": choices, "gold": gold})
    return docs


def wiki_qa(count: int, tokenizer=None, min_tokens: int = 1500, max_tokens: int = 2000, seed: int = 0) -> list[dict]:
    """Long-document multiple choice: `context` joins 'eval' articles, each after an "Article: <title>" line,
    into `min_tokens` to `max_tokens` tokens; `question` asks which one holds a quoted sentence (never an
    article's first); `choices` are four of the titles (the right one, `gold`, among them), in context order."""
    articles, spans, text, measure = split_articles("eval"), _sentences(), split_text("eval"), _measure(tokenizer)
    rng = random.Random(f"wiki_qa-{min_tokens}-{max_tokens}-{seed}")
    docs = []
    while len(docs) < count:
        chosen, blocks = [], []
        for a in rng.sample(range(len(articles)), len(articles)):
            block = f"Article: {articles[a][0]}\n{articles[a][1]}"
            if measure("\n\n".join([*blocks, block])) <= max_tokens:
                chosen.append(a)
                blocks.append(block)
            if measure("\n\n".join(blocks)) >= min_tokens:
                break
        context = "\n\n".join(blocks)
        candidates = [(i, s) for i, a in enumerate(chosen) for s in spans[a][1:] if _usable(s)]
        candidates = [(i, s) for i, s in candidates if context.count(text[s[0] : s[1]]) == 1]
        if not candidates:
            continue
        holder, (a, b) = rng.choice(candidates)
        shown = sorted([holder, *rng.sample([i for i in range(len(chosen)) if i != holder], min(3, len(chosen) - 1))])
        question = f'\n\nQuestion: Which article contains the sentence: "{text[a:b]}"?\nAnswer:'
        docs.append({"context": context, "question": question, "choices": [articles[chosen[i]][0] for i in shown],
                     "gold": shown.index(holder)})
    return docs
