import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchkv.corpora import DOMAINS, split_text
from torchkv.eval.synthetic import RULER_TASKS, needle_sample, ruler_sample, score, wiki_cloze, wiki_qa

LENGTHS = st.sampled_from([512, 1024, 2048])
SEEDS = st.integers(0, 10_000)


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer alone (the model's weights are not needed here)."""
    from transformers import AutoTokenizer

    from torchkv.models.loader import model_path

    return AutoTokenizer.from_pretrained(model_path(), local_files_only=True)


def _tokens(tokenizer, sample) -> int:
    return len(tokenizer(sample.context + sample.question + sample.target, add_special_tokens=False).input_ids)


@settings(max_examples=15)
@given(task=st.sampled_from(RULER_TASKS), length=LENGTHS, seed=SEEDS, domain=st.sampled_from(list(DOMAINS)))
def test_ruler_sample_fits_and_holds_its_answers(tokenizer, task, length, seed, domain):
    sample = ruler_sample(task, tokenizer, length, seed, domain)
    assert sample == ruler_sample(task, tokenizer, length, seed, domain)
    assert 0.98 * length <= _tokens(tokenizer, sample) <= length
    assert sample.question.startswith("\n\n") and sample.target.startswith(" ")
    assert score(sample, sample.target.upper()) == 1.0
    if task == "common_words":
        counts = Counter(re.findall(r"[a-z]+", sample.context.split(":", 1)[1]))
        least_common_answer = min(counts[a] for a in sample.answers)
        assert least_common_answer > max(c for w, c in counts.items() if w not in sample.answers)
    else:
        assert all(answer in sample.context for answer in sample.answers)


@settings(max_examples=10)
@given(length=LENGTHS, depth=st.floats(0.0, 1.0), seed=SEEDS, domain=st.sampled_from(list(DOMAINS)))
def test_needle_sits_at_its_depth(tokenizer, length, depth, seed, domain):
    sample = needle_sample(tokenizer, length, depth, seed, domain)
    assert sample == needle_sample(tokenizer, length, depth, seed, domain)
    assert 0.98 * length <= _tokens(tokenizer, sample) <= length
    offset = sample.context.index(f"is: {sample.answers[0]}.")
    assert abs(offset / len(sample.context) - depth) <= 0.05
    far = round((0.75 if depth < 0.5 else 0.25) * len(sample.context))  # away from the needle
    assert sample.context[far : far + 60] in split_text("eval", domain)  # the haystack is that domain's text


def test_score_is_recall_of_the_answers(tokenizer):
    sample = ruler_sample("niah_multivalue", tokenizer, 512, 0)
    assert score(sample, f"{sample.answers[0]} and {sample.answers[2]}") == 0.5
    assert score(sample, "") == 0.0


def test_bad_arguments_say_what_to_do(tokenizer):
    with pytest.raises(ValueError, match="niah_single, niah_multikey"):
        ruler_sample("niah_triple", tokenizer, 512, 0)
    with pytest.raises(ValueError, match="use length >= "):
        ruler_sample("variable_tracking", tokenizer, 64, 0)
    with pytest.raises(ValueError, match="depth"):
        needle_sample(tokenizer, 512, 1.5, 0)


def test_wiki_cloze_offers_the_true_next_sentence(tokenizer):
    docs = wiki_cloze(3, tokenizer, context_tokens=300, seed=1)
    assert docs == wiki_cloze(3, tokenizer, context_tokens=300, seed=1)
    for doc in docs:
        assert len(doc["choices"]) == 4 and len(set(doc["choices"])) == 4
        assert doc["context"].endswith((".", "!", "?"))
        assert len(tokenizer(doc["context"]).input_ids) >= 300


def test_wiki_qa_quotes_a_body_sentence_of_the_gold_article():
    docs = wiki_qa(3, seed=2)
    for doc in docs:
        sentence = re.search(r'sentence: "(.*)"\?', doc["question"], re.DOTALL).group(1)
        blocks = doc["context"].split("\n\nArticle: ")
        titles = [b.removeprefix("Article: ").split("\n", 1)[0] for b in blocks]
        assert [t for t in titles if t in doc["choices"]] == doc["choices"]  # four of them, in context order
        body = blocks[titles.index(doc["choices"][doc["gold"]])].split("\n", 1)[1]
        assert sentence in body and not body.startswith(sentence)
