"""Chapter 07's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades four students: the reference (full marks), the untouched release
(zero), one whose correct loop draws u before its proposals (the visible test only: the contract fixes the
order of the draws) and one student with two planted bugs, one per exercise, whose targeted tests are disjoint:

* speculative_accept: p and q swapped in the acceptance ratio (accept when u < q/p) -> the visible
  test and `swapped` only: the residual is still the right one wherever the student rejects, and p == q
  (the bonus test) accepts everything either way;
* speculative_generate: neither cache rolled back -> the visible test, `greedy`, `rounds` and
  `distribution` (the stale caches run ahead of the tokens); `bonus` passes: with an identical draft
  nothing is ever rejected.

The loop's tests pass the course's acceptance rule (checks.speculative_accept_oracle) as ``speculative_accept``,
so the exercise-1 bug costs nothing in exercise 2. tests/chapters/ch07/test_hidden_07.py runs the same cells against more
bugs, one at a time and without nbgrader (the bonus token dropped, p one position off, ...).
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("07-speculative", "speculative")
ACC, GEN = "speculative_accept-solution", "speculative_generate-solution"


def planted() -> dict:
    solution = CH.mutate(GEN, "target_cache.crop(n + a)", "pass")
    return CH.solved({
        ACC: CH.mutate(ACC, "if u[i] >= p[i, x] / q[i, x]:", "if u[i] >= q[i, x] / p[i, x]:"),
        GEN: solution.replace("draft_cache.crop(min(draft_cache.length, n + a))", "pass"),
    })


def u_drawn_first() -> dict:
    """A correct loop whose uniforms come before its proposals: the other order of the draws, which the contract
    rules out (its seeded runs are not the chapter's): the visible test only, which names the order."""
    U = "        u = torch.rand(K, generator=generator, dtype=torch.float64)\n"
    DRAFT = "        new, drafted, q = tokens[:, draft_cache.length:], [], []\n"
    return CH.solved({GEN: CH.mutate(GEN, U, "").replace(DRAFT, DRAFT + U)})


STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted": (planted, failing("speculative_accept", "visible", "swapped")
                | failing("speculative_generate", "visible", "greedy", "rounds", "distribution")),
    "u_first": (u_drawn_first, failing("speculative_generate", "visible")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=14)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted")
    assert "are p and q swapped?" in messages["speculative_accept-visible"]
    assert "do your caches still hold rejected proposals?" in messages["speculative_generate-visible"]
    assert "you draw u before the proposals" in roundtrip.messages(graded, CH, "u_first")["speculative_generate-visible"]
