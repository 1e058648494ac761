"""Chapter 12's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades three students: the reference (full marks), the untouched release
(zero) and one student with three planted bugs, one per exercise:

* slot_mapping: block + offset, not block * block_size + offset -> every test of the exercise;
* paged_attention: the scores not scaled by sqrt(Dh) -> every test of the exercise;
* schedule_step: the oldest running sequence preempted instead of the most recent -> the visible test and
  `preempt`; `budget` passes (no preemption there).

tests/chapters/ch12/test_hidden_12.py runs the same cells against more bugs, one at a time and without nbgrader.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("12-serving", "serving")
SLOTS, ATTN, SCHED = "slot_mapping-solution", "paged_attention-solution", "schedule_step-solution"


def planted() -> dict:
    return CH.solved({
        SLOTS: CH.mutate(SLOTS, "return block * block_size + offset", "return block + offset"),
        ATTN: CH.mutate(ATTN, "attn_mask=valid[:, None, None, :])", "attn_mask=valid[:, None, None, :], scale=1.0)"),
        SCHED: CH.mutate(SCHED, "victim = candidates.pop()", "victim = candidates.pop(0)"),
    })



STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted": (planted, failing("slot_mapping", "visible", "scattered", "edges")
                | failing("paged_attention", "visible", "partial", "batch")
                | failing("schedule_step", "visible", "preempt")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=12)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted")
    assert "block + offset is not a slot" in messages["slot_mapping-visible"]
    assert "not scaled" in messages["paged_attention-visible"]
    assert "the most recent running sequence" in messages["schedule_step-visible"]


