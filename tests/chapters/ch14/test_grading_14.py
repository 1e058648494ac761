"""Chapter 14's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades three students: the reference (full marks), the untouched release
(zero) and one student with three planted bugs, one per exercise:

* online_softmax: the running sum not rescaled when the max grows -> the visible test and `rescale`;
  `masked` passes (its maxima never grow after a finite sum);
* merge_partials: the plain average of the partial outputs -> every test of the exercise;
* tiled_attention: the causal diagonal off by one (each query misses its own key) -> the visible test,
  `causal` and `memory` (which checks the values of a causal call too); `tiles` and `mask` pass (no causality).

tests/chapters/ch14/test_hidden_14.py runs the same cells against more bugs, one at a time and without nbgrader.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("14-tiled-attention", "tiled_attention")
OS, MP, TA = "online_softmax-solution", "merge_partials-solution", "tiled_attention-solution"
KEEP = "keep = torch.arange(i, i + n_q, device=q.device)[:, None] >= torch.arange(j, j + n_k, device=q.device)"


def planted() -> dict:
    return CH.solved({
        OS: CH.mutate(OS, "l = l * torch.exp(m - m_safe) + torch.exp(x - m_safe[..., None]).sum(-1)",
                      "l = l + torch.exp(x - m_safe[..., None]).sum(-1)"),
        MP: CH.mutate(MP, "return terms.sum(0), lse", "return outs.mean(0), lse"),
        TA: CH.mutate(TA, KEEP, KEEP.replace(">=", ">")),
    })


STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted": (planted, failing("online_softmax", "visible", "rescale")
                | failing("merge_partials", "visible", "many", "empty")
                | failing("tiled_attention", "visible", "causal", "memory")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=12)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted")
    assert "the running sum is not rescaled" in messages["online_softmax-visible"]
    assert "plain average" in messages["merge_partials-visible"]
    assert "each query misses its own key" in messages["tiled_attention-visible"]
