"""course_lib.claims: the printed claim is the checked one, and a false claim stops the notebook."""
from __future__ import annotations

import math

import pytest

from course_lib.claims import above, below, between


@pytest.mark.parametrize("value, bound, text", [(2.4e-7, 1e-6, "below 1e-6"), (3.4e-14, 1e-12, "below 1e-12"),
                                                (0.0, 5e-5, "below 5e-5"), (0.004, 0.01, "below 0.01"), (3.0, 10, "below 10")])
def test_below_prints_the_bound_it_checked(value, bound, text):
    assert below(value, bound) == text


@pytest.mark.parametrize("value", [1e-6, 2e-6, math.nan, math.inf])
def test_below_refuses_a_value_at_or_over_the_bound_and_nan(value):
    with pytest.raises(AssertionError, match="below"):
        below(value, 1e-6)


def test_above_and_between_format_their_bounds():
    assert above(0.985, 0.95, "{:.0%}") == "above 95%"
    assert between(0.546, 0.4, 0.7, "{:.0%}") == "between 40% and 70%"
    assert between(2.1, 2, 2.3) == "between 2 and 2.3"
    with pytest.raises(AssertionError, match="between 0.4 and 0.7"):
        between(0.71, 0.4, 0.7)
    with pytest.raises(AssertionError):
        above(math.nan, 0)
    with pytest.raises(ValueError, match="low must be below high"):
        between(1, 2, 2)
