"""Chapter 15's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades three students: the reference (full marks), the untouched release
(zero) and one student with two planted bugs, one per exercise:

* token_index built over characters (each token's bytes decoded, a broken character replaced) -> the visible
  test and `bytes` (tokens that end inside a character are never allowed); `walk` passes (ASCII patterns);
* constrained_mask allowing EOS whatever the state -> the visible test and `eos`; `generate` passes (bpe-gpt has
  no EOS).

tests/chapters/ch15/test_hidden_15.py runs the same cells against more bugs, one at a time and without nbgrader.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("15-structured-decoding", "structured_decoding")
TI, CM = "token_index-solution", "constrained_mask-solution"
WALK = "end = dfa.walk(state, data) if data else None"


def planted() -> dict:
    return CH.solved({
        TI: CH.mutate(TI, WALK, 'data = data.decode("utf-8", errors="replace").encode()\n            ' + WALK),
        CM: CH.mutate(CM, "if accepting and eos_token_id is not None:", "if eos_token_id is not None:"),
    })


STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted": (planted, failing("token_index", "visible", "bytes") | failing("constrained_mask", "visible", "eos")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=8)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted")
    assert "build the index over bytes, not characters" in messages["token_index-visible"]
    assert "EOS is allowed in a state that is not accepting" in messages["constrained_mask-visible"]
