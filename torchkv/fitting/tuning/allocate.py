"""Choosing one option per item to minimise a summed cost under a budget on summed bits (multiple-choice knapsack)."""

import numpy as np

#: bits are counted in steps of 1/RESOLUTION, each option's rounded up, so a chosen allocation never exceeds the budget
RESOLUTION = 256


def allocate(bits: list[list[float]], costs: list[list[float]], budget: float) -> list[int]:
    """The option of each item that minimises `Σ costs[i][choice_i]` subject to `mean_i bits[i][choice_i] <= budget`.

    Exact dynamic programming over bits in steps of 1/RESOLUTION (rounded up: the chosen allocation's exact mean
    never exceeds `budget`); O(items x options x budget·items·RESOLUTION).

    Raises:
        ValueError: the budget is below the cheapest allocation (the message gives the reachable range).
    """
    if len(bits) != len(costs) or any(len(b) != len(c) or not b for b, c in zip(bits, costs)):
        raise ValueError("allocate needs, for every item, as many costs as bit options (at least one)")
    lowest = sum(min(b) for b in bits) / len(bits)
    highest = sum(max(b) for b in bits) / len(bits)
    if budget < lowest - 1e-9:
        raise ValueError(f"a budget of {budget:g} bits per value is below what the candidate settings reach: "
                         f"{lowest:.4g} to {highest:.4g} bits per value")
    weights = [np.ceil(np.asarray(b) * RESOLUTION - 1e-6).astype(np.int64) for b in bits]
    capacity = int(np.floor(budget * len(bits) * RESOLUTION + 1e-6))
    capacity = max(capacity, int(sum(w.min() for w in weights)))  # rounding up must not exclude the cheapest
    best = np.zeros(capacity + 1)  # least cost of the items so far within each number of bit steps
    choices = []
    for w, c in zip(weights, costs):
        options = np.full((len(w), capacity + 1), np.inf)
        for j, (wj, cj) in enumerate(zip(w, c)):
            if wj <= capacity:
                options[j, wj:] = best[: capacity + 1 - wj] + cj
        choices.append(options.argmin(0))
        best = options.min(0)
    chosen, room = [], capacity
    for w, choice in zip(reversed(weights), reversed(choices)):
        j = int(choice[room])
        chosen.append(j)
        room -= int(w[j])
    return chosen[::-1]
