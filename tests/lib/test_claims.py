"""course_lib.claims: the printed claim is the checked one, the measured value stands beside it (masked for
nbval, so stored outputs stay portable), and a false claim stops the notebook."""
from __future__ import annotations

import math
import re

import pytest
from nbval.plugin import get_sanitize_patterns

from course_lib.claims import above, below, between
from tests.helpers import ROOT


@pytest.mark.parametrize("value, bound, text", [(2.4e-7, 1e-6, "2.4e-7, checked: below 1e-6"),
                                                (3.4e-14, 1e-12, "3.4e-14, checked: below 1e-12"),
                                                (0.0, 5e-5, "0, checked: below 5e-5"), (0.004, 0.01, "0.004, checked: below 0.01"),
                                                (3.0, 10, "3, checked: below 10"), (2.8712, 3.5, "2.87, checked: below 3.5")])
def test_below_prints_the_value_beside_the_bound_it_checked(value, bound, text):
    assert below(value, bound) == text


@pytest.mark.parametrize("value", [1e-6, 2e-6, math.nan, math.inf])
def test_below_refuses_a_value_at_or_over_the_bound_and_nan(value):
    with pytest.raises(AssertionError, match="below"):
        below(value, 1e-6)


def test_above_and_between_format_their_bounds():
    assert above(0.985, 0.95, "{:.0%}") == "98%, checked: above 95%"
    assert between(0.546, 0.4, 0.7, "{:.0%}") == "55%, checked: between 40% and 70%"
    assert between(2.1, 2, 2.3) == "2.1, checked: between 2 and 2.3"
    with pytest.raises(AssertionError, match="between 0.4 and 0.7"):
        between(0.71, 0.4, 0.7)
    with pytest.raises(AssertionError):
        above(math.nan, 0)
    with pytest.raises(ValueError, match="low must be below high"):
        between(1, 2, 2)


def _sanitized(text: str) -> str:
    """What nbval compares: the text after every sanitizer of tests/nbval_sanitize.cfg, read by nbval itself."""
    for regex, replace in get_sanitize_patterns((ROOT / "tests" / "nbval_sanitize.cfg").read_text()):
        text = re.sub(regex, replace, text)
    return text


@pytest.mark.parametrize("here, there", [
    (below(2.4e-7, 1e-6), below(3.1e-7, 1e-6)),
    (f"loss {between(2.8712, 2.5, 3.5)} nats", f"loss {between(2.9, 2.5, 3.5)} nats"),
    (f"share {above(0.613, 0.6, '{:.0%}')} (of the step)", f"share {above(0.87, 0.6, '{:.0%}')} (of the step)"),
])
def test_the_measured_value_is_masked_for_nbval_and_the_claim_is_not(here, there):
    assert here != there and _sanitized(here) == _sanitized(there)
    assert "checked: " in _sanitized(here) and _sanitized(below(1e-7, 1e-6)) != _sanitized(below(1e-7, 1e-5))
