"""Datasets of the offline lm-evaluation-harness tasks in this folder, built by `torchkv.eval.synthetic` with
fixed seeds and measured in SmolLM2 tokens (its tokenizer alone is loaded; nothing is downloaded)."""

import functools

import datasets

from torchkv.eval import synthetic


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer

    from torchkv.models.loader import model_path

    return AutoTokenizer.from_pretrained(model_path(), local_files_only=True)


def _test_split(docs: list[dict]) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def ruler(ruler_task: str, length: int, count: int = 20, **_metadata) -> datasets.DatasetDict:
    """`count` samples (seeds 0, 1, ...) of one RULER task at `length` tokens."""
    samples = [synthetic.ruler_sample(ruler_task, _tokenizer(), length, seed) for seed in range(count)]
    return _test_split([{**vars(s), "answers": list(s.answers)} for s in samples])


def wiki_cloze(count: int = 100, **_metadata) -> datasets.DatasetDict:
    return _test_split(synthetic.wiki_cloze(count, _tokenizer()))


def wiki_qa(count: int = 50, **_metadata) -> datasets.DatasetDict:
    return _test_split(synthetic.wiki_qa(count, _tokenizer()))


def recall(doc: dict, results: list[str]) -> dict[str, float]:
    """RULER's string-match recall of the generated text."""
    return {"recall": synthetic.score(synthetic.Sample(**{**doc, "answers": tuple(doc["answers"])}), results[0])}
