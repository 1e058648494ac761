"""Chapter 06's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades four students: the reference (full marks), the untouched release
(zero) and two students with three planted bugs each, one per exercise, in different exercises, so
that the tests each bug must fail are disjoint. The expected failures follow from what each test cell
documents (its first comment line); tests/chapters/ch06/test_hidden_06.py runs the same cells against many more
bugs, one at a time and without nbgrader. The exercises are independent functions, so a bug in one
cannot cost points in another.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("06-decoding", "decoding")
TEMP, TOPK, TOPP = "temperature-solution", "top_k-solution", "top_p-solution"
REP, GREEDY, BEAM = "repetition_penalty-solution", "greedy-solution", "beam_search-solution"
ZERO_BRANCH = """    if temperature == 0:
        is_max = logits == logits.amax(dim=-1, keepdim=True)
        return torch.where(is_max, 0.0, float("-inf")).to(logits.dtype)
"""


def planted_a() -> dict:
    return CH.solved({
        # temperature 0 divides by zero (no limit branch) -> visible and zero (the other temperatures are right)
        TEMP: CH.mutate(TEMP, ZERO_BRANCH, ""),
        # the token that crosses p is dropped -> visible, crossing and order (a tiny p still keeps the top token)
        TOPP: CH.mutate(TOPP, "drop = tail_mass <= 1 - p", "drop = tail_mass - sorted_logits.softmax(dim=-1) < 1 - p"),
        # one row's EOS stops the whole batch -> visible, batch_eos and padding (stop: both rows end together)
        GREEDY: CH.mutate(GREEDY, "if finished.all():", "if finished.any():"),
    })


def planted_b() -> dict:
    return CH.solved({
        # returns probabilities instead of logits -> visible, large and logits (the kept set is still right)
        TOPK: CH.mutate(TOPK, 'return logits.masked_fill(logits < kth_largest, float("-inf"))',
                        'return logits.softmax(-1).masked_fill(logits < kth_largest, float("-inf"))'),
        # divides negative logits too, raising them -> visible, negative and rows (once uses positive logits)
        REP: CH.mutate(REP, "score = torch.where(score < 0, score * penalty, score / penalty)", "score = score / penalty"),
        # the length penalty counts the prompt -> every test but errors (the scores, and the rankings they decide)
        BEAM: CH.mutate(BEAM, "(cur_len + 1 - T0) ** length_penalty", "(cur_len + 1) ** length_penalty"),
    })



STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted_a": (planted_a, failing("temperature", "visible", "zero") | failing("top_p", "visible", "crossing", "order")
                  | failing("greedy", "visible", "batch_eos", "padding")),
    "planted_b": (planted_b, failing("top_k", "visible", "large", "logits")
                  | failing("repetition_penalty", "visible", "negative", "rows")
                  | failing("beam_search", "visible", "hf", "rows", "brute", "eos")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=33)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    a = roundtrip.messages(graded, CH, "planted_a")
    assert "temperature 0 gave NaN" in a["temperature-visible"]
    assert "the other rows go on" in a["greedy-visible"]
    b = roundtrip.messages(graded, CH, "planted_b")
    assert "RAISES it" in b["repetition_penalty-visible"]
    assert "the length penalty counts the prompt" in b["beam_search-visible"]
