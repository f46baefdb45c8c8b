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
    assert sum(c[j] for c, j in zip(costs, choice)) == pytest.approx(best_alone(instance))


def best_alone(instance) -> float:
    """The least summed cost of any choice within the budget, by enumeration."""
    bits, costs, budget = instance
    return min(sum(c[j] for c, j in zip(costs, combo))
               for combo in itertools.product(*(range(len(b)) for b in bits))
               if sum(b[j] for b, j in zip(bits, combo)) / len(bits) <= budget + 1e-12)


def test_a_budget_below_the_cheapest_allocation_states_the_reachable_range():
    with pytest.raises(ValueError, match=r"below what the candidate settings reach: 1\.5 to 6"):
        allocate([[1.0, 4.0], [2.0, 8.0]], [[1.0, 0.0], [1.0, 0.0]], 1.25)


@given(instances(), st.data())
def test_a_subset_held_to_the_budget_too_takes_the_cheapest_choice_that_meets_both_means(instance, data):
    """`within`: the layers that hold every token of a model with sliding-window layers; their mean bits are what the
    cache's bits per value tend to at long contexts, so the allocation keeps both means within the budget."""
    bits, costs, budget = instance
    within = data.draw(st.sets(st.integers(0, len(bits) - 1), min_size=1))
    lowest = sum(min(bits[i]) for i in within) / len(within)
    if budget < lowest:
        with pytest.raises(ValueError, match="the mean over the .* items `within`"):
            allocate(bits, costs, budget, within)
        return

    def meets(combo):
        return (sum(b[j] for b, j in zip(bits, combo)) / len(bits) <= budget + 1e-12
                and sum(bits[i][combo[i]] for i in within) / len(within) <= budget + 1e-12)

    choice = allocate(bits, costs, budget, within)
    assert meets(choice)
    best = min(sum(c[j] for c, j in zip(costs, combo))
               for combo in itertools.product(*(range(len(b)) for b in bits)) if meets(combo))
    assert sum(c[j] for c, j in zip(costs, choice)) == pytest.approx(best)
    every = [allocate(bits, costs, budget, range(len(bits))), allocate(bits, costs, budget)]  # one constraint twice
    assert [sum(c[j] for c, j in zip(costs, choice)) for choice in every] == pytest.approx([best_alone(instance)] * 2)
