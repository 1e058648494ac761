"""Chapter 13's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades three students: the reference (full marks), the untouched release
(zero) and one student with three planted bugs, one per exercise:

* induction_score: key t - period (the earlier occurrence itself, a duplicate-token score) -> the visible
  test, `copies` and `model`;
* build_induction_model: layer 2's keys read the current token (it copies A, not B) -> the visible test,
  `vocab` and `recall`;
* ablate_head: the hook removed without `finally` -> the visible test only (`gpt` and `circuit` raise nothing
  inside the block).

tests/chapters/ch13/test_hidden_13.py runs the same cells against more bugs, one at a time and without nbgrader.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("13-heads", "heads")
IS, BIM, AH = "induction_score-solution", "build_induction_model-solution", "ablate_head-solution"


def planted() -> dict:
    return CH.solved({
        IS: CH.mutate(IS, "keys = queries - period + 1", "keys = queries - period"),
        BIM: CH.mutate(BIM, "W[C:C + V, PREV:PREV + V] = eye_v", "W[C:C + V, TOK:TOK + V] = eye_v"),
        AH: CH.mutate(AH, "    try:\n        yield model\n    finally:  # restore, even if the block raised\n        handle.remove()", "    yield model\n    handle.remove()"),
    })


STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted": (planted, failing("induction_score", "visible", "copies", "model")
                | failing("build_induction_model", "visible", "vocab", "recall")
                | failing("ablate_head", "visible")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=10)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted")
    assert "the earlier occurrence of the query's own token" in messages["induction_score-visible"]
    assert "copies A instead of B" in messages["build_induction_model-visible"]
    assert "in a `finally:`" in messages["ablate_head-visible"]
