"""The architecture x preset matrix: every registered preset on a tiny model of every family, left-padded batch
and sliding windows included: every cell must generate with compressed tokens read in every layer.
`make test` runs one preset of each recipe; the whole matrix (and the README's copy of it) is `make test-slow`."""

from pathlib import Path

import pytest

from torchkv.eval.support import REPRESENTATIVES, support_markdown, support_matrix
from torchkv.testing import TINY_ARCHITECTURES

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def matrix():
    return support_matrix()


def _check(matrix: dict, model_type: str) -> None:
    refused = {preset: row[model_type] for preset, row in matrix.items() if row[model_type] is not None}
    assert not refused, f"presets refuse {model_type}: {refused}"


@pytest.mark.parametrize("model_type", sorted(TINY_ARCHITECTURES))
def test_one_preset_of_each_recipe_runs_on_the_family(model_type):
    _check(support_matrix(list(REPRESENTATIVES), [model_type]), model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(TINY_ARCHITECTURES))
def test_every_preset_runs_on_the_family(matrix, model_type):
    _check(matrix, model_type)


@pytest.mark.slow
def test_readme_matrix_is_generated(matrix):
    block = README.read_text().split("<!-- matrix:begin -->")[1].split("<!-- matrix:end -->")[0].strip()
    assert block == support_markdown(matrix).strip(), "regenerate with: python -m torchkv presets --matrix"
