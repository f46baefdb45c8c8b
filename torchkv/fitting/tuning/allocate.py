"""Choosing one option per item to minimise a summed cost under a budget on summed bits (multiple-choice knapsack)."""

from collections.abc import Sequence

import numpy as np

#: bits are counted in steps of 1/RESOLUTION, each option's rounded up, so a chosen allocation never exceeds the budget
RESOLUTION = 256


def allocate(bits: list[list[float]], costs: list[list[float]], budget: float, within: Sequence[int] = ()
             ) -> list[int]:
    """The option of each item that minimises `Σ costs[i][choice_i]` subject to `mean_i bits[i][choice_i] <= budget`
    and, where `within` names some items, their own mean bits `<= budget` too.

    Exact dynamic programming over bits in steps of 1/RESOLUTION (rounded up: the chosen allocation's exact means
    never exceed `budget`); O(items x options x budget·items·RESOLUTION). With `within`, one table for those items
    and one for the rest, joined at the split of the bit steps that costs least.

    Raises:
        ValueError: the budget is below the cheapest allocation (the message gives the reachable range).
    """
    if len(bits) != len(costs) or any(len(b) != len(c) or not b for b, c in zip(bits, costs)):
        raise ValueError("allocate needs, for every item, as many costs as bit options (at least one)")
    inside = sorted(set(within))
    for items in ([range(len(bits))] + ([inside] if inside else [])):
        lowest, highest = (sum(f(bits[i]) for i in items) / len(items) for f in (min, max))
        if budget < lowest - 1e-9:
            part = "" if len(items) == len(bits) else f" (the mean over the {len(items)} items `within`)"
            raise ValueError(f"a budget of {budget:g} bits per value is below what the candidate settings reach"
                             f"{part}: {lowest:.4g} to {highest:.4g} bits per value")
    weights = [np.ceil(np.asarray(b) * RESOLUTION - 1e-6).astype(np.int64) for b in bits]
    capacity = _capacity(budget, weights)
    if not inside:
        return _trace(weights, _tables(weights, costs, capacity)[1], capacity)
    rest = [i for i in range(len(bits)) if i not in set(inside)]
    (best_in, choices_in), (best_rest, choices_rest) = (
        _tables([weights[i] for i in part], [costs[i] for i in part], room)
        for part, room in ((inside, min(capacity, _capacity(budget, [weights[i] for i in inside]))), (rest, capacity)))
    # the least total cost over every split: `inside` within `room` bit steps, the rest within what is left
    room = int((best_in + best_rest[capacity - np.arange(len(best_in))]).argmin())
    chosen = dict(zip(inside, _trace([weights[i] for i in inside], choices_in, room)))
    chosen.update(zip(rest, _trace([weights[i] for i in rest], choices_rest, capacity - room)))
    return [chosen[i] for i in range(len(bits))]


def _capacity(budget: float, weights: list[np.ndarray]) -> int:
    """Bit steps `weights`' items may take within a mean of `budget` (rounding up must not exclude the cheapest)."""
    return max(int(np.floor(budget * len(weights) * RESOLUTION + 1e-6)), int(sum(w.min() for w in weights)))


def _tables(weights: list[np.ndarray], costs: list[list[float]], capacity: int) -> tuple[np.ndarray, list]:
    """The least cost of all the items within each number of bit steps up to `capacity`, and each item's best option
    by the steps left to it and the items before it."""
    best = np.zeros(capacity + 1)  # least cost of the items so far within each number of bit steps
    choices = []
    for w, c in zip(weights, costs):
        options = np.full((len(w), capacity + 1), np.inf)
        for j, (wj, cj) in enumerate(zip(w, c)):
            if wj <= capacity:
                options[j, wj:] = best[: capacity + 1 - wj] + cj
        choices.append(options.argmin(0))
        best = options.min(0)
    return best, choices


def _trace(weights: list[np.ndarray], choices: list, room: int) -> list[int]:
    """Each item's option from `_tables`' choices, the last item first, within `room` bit steps."""
    chosen = []
    for w, choice in zip(reversed(weights), reversed(choices)):
        j = int(choice[room])
        chosen.append(j)
        room -= int(w[j])
    return chosen[::-1]
