"""The bit allocation is the exact optimum of its multiple-choice knapsack."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchkv.fitting.tuning import allocate


@st.composite
def instances(draw):
    items = draw(st.integers(1, 5))
    bits = [draw(st.lists(st.integers(8, 128).map(lambda b: b / 8), min_size=1, max_size=4)) for _ in range(items)]
    costs = [draw(st.lists(st.floats(0, 10), min_size=len(b), max_size=len(b))) for b in bits]
    low, high = (sum(f(b) for b in bits) / items for f in (min, max))
    budget = draw(st.floats(low, high + 1))
    return bits, costs, budget


@given(instances())
def test_allocation_is_the_cheapest_within_the_budget(instance):
    bits, costs, budget = instance
    choice = allocate(bits, costs, budget)
    assert sum(b[j] for b, j in zip(bits, choice)) / len(bits) <= budget + 1e-12
    best = min(sum(c[j] for c, j in zip(costs, combo))
               for combo in itertools.product(*(range(len(b)) for b in bits))
               if sum(b[j] for b, j in zip(bits, combo)) / len(bits) <= budget + 1e-12)
    assert sum(c[j] for c, j in zip(costs, choice)) == pytest.approx(best)


def test_a_budget_below_the_cheapest_allocation_states_the_reachable_range():
    with pytest.raises(ValueError, match=r"below what the candidate settings reach: 1\.5 to 6"):
        allocate([[1.0, 4.0], [2.0, 8.0]], [[1.0, 0.0], [1.0, 0.0]], 1.25)
