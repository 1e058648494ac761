"""Chapter 07's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades three students: the reference (full marks), the untouched release
(zero) and one student with two planted bugs, one per exercise, whose targeted tests are disjoint:

* speculative_accept: p and q swapped in the acceptance ratio (accept when u < q/p) -> the visible
  test and `swapped` only: the residual is still the right one wherever the student rejects, and p == q
  (the bonus test) accepts everything either way;
* speculative_step: neither cache rolled back -> the visible test, `rollback` and `greedy` (the stale
  cache runs ahead of the tokens); `bonus` passes: with an identical draft nothing is ever rejected.

The step's tests pass the course's acceptance rule (checks.speculative_accept_oracle) as ``accept``, so
the exercise-1 bug costs nothing in exercise 2. tests/chapters/ch07/test_hidden_07.py runs the same cells against more
bugs, one at a time and without nbgrader (residual not renormalised, bonus token missing, ...).
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("07-speculative", "speculative")
ACC, STEP = "speculative_accept-solution", "speculative_step-solution"


def planted() -> dict:
    solution = CH.mutate(STEP, "target_cache.crop(n + a)", "pass")
    return CH.solved({
        ACC: CH.mutate(ACC, "if u[i] >= p[i, x] / q[i, x]:", "if u[i] >= q[i, x] / p[i, x]:"),
        STEP: solution.replace("draft_cache.crop(min(draft_cache.length, n + a))", "pass"),
    })



STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted": (planted, failing("speculative_accept", "visible", "swapped") | failing("speculative_step", "visible", "rollback", "greedy")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=8)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted")
    assert "are p and q swapped?" in messages["speculative_accept-visible"]
    assert "target_cache.crop(n + a)" in messages["speculative_step-visible"]
