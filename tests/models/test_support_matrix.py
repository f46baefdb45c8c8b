"""The architecture x preset matrix: every registered preset on a tiny model of every family, left-padded batch
and sliding windows included; a refusal must state a reason listed in `torchkv.eval.support.REFUSALS`.
`make test` runs one preset of each recipe; the whole matrix (and the README's copy of it) is `make test-slow`."""

import re
from pathlib import Path

import pytest

from torchkv.eval.support import REPRESENTATIVES, listed_refusal, support_markdown, support_matrix
from torchkv.testing import TINY_ARCHITECTURES

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def matrix():
    return support_matrix()


def _check(matrix: dict, model_type: str) -> None:
    for preset in matrix:
        message, reason = matrix[preset][model_type], listed_refusal(preset, model_type)
        if reason is None:
            assert message is None, f"{preset} refuses {model_type} without a listed reason: {message}"
        else:
            assert message is not None, f"{preset} runs on {model_type}: remove its listed refusal"
            assert re.search(reason, message), f"{preset} on {model_type}: {message!r} does not state {reason!r}"


@pytest.mark.parametrize("model_type", sorted(TINY_ARCHITECTURES))
def test_one_preset_of_each_recipe_runs_on_the_family_or_refuses_for_a_listed_reason(model_type):
    _check(support_matrix(list(REPRESENTATIVES), [model_type]), model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(TINY_ARCHITECTURES))
def test_every_preset_runs_on_the_family_or_refuses_for_a_listed_reason(matrix, model_type):
    _check(matrix, model_type)


@pytest.mark.slow
def test_readme_matrix_is_generated(matrix):
    block = README.read_text().split("<!-- matrix:begin -->")[1].split("<!-- matrix:end -->")[0].strip()
    assert block == support_markdown(matrix).strip(), "regenerate with: python -m torchkv presets --matrix"
