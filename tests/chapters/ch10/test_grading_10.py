"""Chapter 10's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades three students: the reference (full marks), the untouched release
(zero) and one student with four planted bugs, one per exercise, whose targeted tests are disjoint:

* training_flops: 6 * N * D in integer arithmetic -> the visible test and `overflow` (int64 arrays of GPT-3's
  and Chinchilla's sizes wrap around 2^63; Python numbers and float arrays are right);
* fit_power_law: each offset judged by the residuals of its own line, in log(loss - E), instead of those of
  log(loss) -> the visible test and `logspace` (exact power laws are recovered either way; noise invisible to
  the comparison in log(loss) is not invisible in log(loss - E), whose scale changes with E);
* isoflop_analysis: the best run's size taken as N_opt instead of the parabola's minimum -> the visible test,
  `surface` (the loss surface's optimum is no size trained) and `shipped` (the vertices of section 4's windows
  and of exact parabolas);
  `identity` (6ND = C, a + b = 1) and `errors` pass;
* compute_optimal: the 6 of 6ND forgotten -> the visible test and `budget`; `ratio` passes (D = rN holds).

tests/chapters/ch10/test_hidden_10.py runs the same cells against more bugs, one at a time and without nbgrader.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("10-scaling-laws", "scaling_laws")
FLOPS, FIT, ISO, OPT = ("training_flops-solution", "fit_power_law-solution", "isoflop_analysis-solution",
                        "compute_optimal-solution")


def planted() -> dict:
    return CH.solved({
        FLOPS: CH.mutate(FLOPS, "return 6.0 * n_params * n_tokens", "return 6 * n_params * n_tokens"),
        FIT: CH.mutate(FIT, "sse = float(np.sum((np.log(loss) - np.log(fitted)) ** 2))",
                       "sse = float(np.sum((X @ coef - np.log(loss - E)) ** 2))"),
        ISO: CH.mutate(ISO, "n_opt = math.exp(-slope / (2 * curvature))", "n_opt = n[int(loss.argmin())]"),
        OPT: CH.mutate(OPT, "n_params = math.sqrt(flops / (6 * tokens_per_param))", "n_params = math.sqrt(flops / tokens_per_param)"),
    })



STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted": (planted, failing("training_flops", "visible", "overflow") | failing("fit_power_law", "visible", "logspace")
                | failing("isoflop_analysis", "visible", "surface", "shipped")
                | failing("compute_optimal", "visible", "budget")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=19)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted")
    assert "did you forget the 6 of C = 6ND?" in messages["compute_optimal-visible"]
    assert "wraps around 2^63" in messages["training_flops-overflow"]
    assert "wrapped around without a warning" in messages["training_flops-visible"]
    assert "that is the best run's size" in messages["isoflop_analysis-visible"]
    assert "the offset whose own line fits best, in log(loss - E)" in messages["fit_power_law-visible"]
