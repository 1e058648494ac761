"""Chapter 10's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with ONE
planted bug. Every bug must fail exactly the tests documented to target it (the comment at the top of each
cell), and correct alternative implementations must pass everything. The hidden tests' oracles are synthetic
losses of known (E, A, alpha), among them losses with noise that only a log-space fit cannot see
(checks.planted_noise_losses), and the defining equations 6ND = C and D = rN.
tests/chapters/ch10/test_grading_10.py checks the same on whole notebooks through nbgrader.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from course_lib import checks
from tests.cell_harness import TestCells
from tests.helpers import ROOT

SOURCE = ROOT / "solutions" / "10-scaling-laws" / "scaling_laws.ipynb"
HARNESS = TestCells(SOURCE, {"np": np, "math": math, "checks": checks})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

FLOPS, FIT, OPT = "training_flops", "fit_power_law", "compute_optimal"
SIX = "return 6.0 * n_params * n_tokens"
SSE = "sse = float(np.sum((np.log(loss) - np.log(fitted)) ** 2))"
SPLIT = "n_params = math.sqrt(flops / (6 * tokens_per_param))"

NO_OFFSET = '''
def fit_power_law(n, loss, offsets=None):
    slope, intercept = np.polyfit(np.log(np.asarray(n, dtype=np.float64)), np.log(np.asarray(loss, dtype=np.float64)), 1)
    return 0.0, float(np.exp(intercept)), float(-slope)
'''

LINEAR_SPACE = '''
def fit_power_law(n, loss, offsets=None):
    # least squares on the losses themselves: for each E, alpha on a grid (vectorised) and A in closed form
    n, loss = np.asarray(n, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    if offsets is None:
        offsets = np.linspace(0.0, loss.min(), 1001)[:-1]
    alphas = np.linspace(0.01, 1.0, 991)
    x = n[None, :] ** -alphas[:, None]  # (alphas, P)
    best = None
    for E in offsets:
        y = loss - E
        A = (x @ y) / (x * x).sum(1)  # (alphas,)
        sse = ((y[None, :] - A[:, None] * x) ** 2).sum(1)
        i = int(sse.argmin())
        if best is None or sse[i] < best[0]:
            best = (sse[i], float(E), float(A[i]), float(alphas[i]))
    return best[1], best[2], best[3]
'''

CASES = [
    # C = 6ND
    (FLOPS, "forward pass only: 2ND", mutate(FLOPS, (SIX, "return 2.0 * n_params * n_tokens")),
     {f"{FLOPS}-visible", f"{FLOPS}-factor", f"{FLOPS}-overflow"}),
    (FLOPS, "integer arithmetic: 6 * N * D wraps around in int64", mutate(FLOPS, (SIX, "return 6 * n_params * n_tokens")),
     {f"{FLOPS}-visible", f"{FLOPS}-overflow"}),  # the visible check's int64 arrays (GPT-3's size) catch it too
    (FLOPS, "correct: numpy float64 arrays", mutate(FLOPS, (SIX, "return 6 * np.asarray(n_params, dtype=np.float64) * np.asarray(n_tokens, dtype=np.float64)")),
     set()),
    # the power-law fit
    (FIT, "no offset: log(loss) against log(n)", NO_OFFSET, {f"{FIT}-visible", f"{FIT}-offset", f"{FIT}-logspace"}),
    (FIT, "offset chosen by the residuals of its own line, in log(loss - E)",
     mutate(FIT, (SSE, "sse = float(np.sum((X @ coef - np.log(loss - E)) ** 2))")), {f"{FIT}-visible", f"{FIT}-logspace"}),
    (FIT, "offset chosen by the residuals in linear space", mutate(FIT, (SSE, "sse = float(np.sum((loss - fitted) ** 2))")),
     {f"{FIT}-visible", f"{FIT}-logspace"}),
    (FIT, "least squares in linear space", LINEAR_SPACE, {f"{FIT}-visible", f"{FIT}-logspace"}),  # the visible check's noisy losses too
    (FIT, "correct: np.polyfit per offset", '''
def fit_power_law(n, loss, offsets=None):
    n, loss = np.asarray(n, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    if offsets is None:
        offsets = np.linspace(0.0, loss.min(), 1001)[:-1]
    fits = []
    for E in offsets:
        slope, intercept = np.polyfit(np.log(n), np.log(loss - E), 1)
        A, alpha = math.exp(intercept), -slope
        fits.append((float(np.sum(np.log(loss / (E + A * n ** -alpha)) ** 2)), float(E), A, alpha))
    sse, E, A, alpha = min(fits, key=lambda f: f[0])
    return E, A, alpha
''', set()),
    # the compute-optimal split
    (OPT, "the 6 of 6ND forgotten", mutate(OPT, (SPLIT, "n_params = math.sqrt(flops / tokens_per_param)")),
     {f"{OPT}-visible", f"{OPT}-budget"}),
    (OPT, "ratio taken as parameters per token", mutate(OPT, (SPLIT, "n_params = math.sqrt(flops * tokens_per_param / 6)"),
                                                       ("return n_params, tokens_per_param * n_params", "return n_params, n_params / tokens_per_param")),
     {f"{OPT}-visible", f"{OPT}-budget", f"{OPT}-ratio"}),  # the budget test's Chinchilla case (r = 20) fails too
    (OPT, "a fixed 20 tokens per parameter", mutate(OPT, (SPLIT, "n_params = math.sqrt(flops / (6 * 20))"),
                                                   ("return n_params, tokens_per_param * n_params", "return n_params, 20 * n_params")),
     {f"{OPT}-visible", f"{OPT}-ratio"}),
    (OPT, "correct: D first", '''
def compute_optimal(flops, tokens_per_param=20.0):
    n_tokens = (flops * tokens_per_param / 6) ** 0.5
    return n_tokens / tokens_per_param, n_tokens
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {FLOPS, FIT, OPT}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) == 3


@pytest.mark.parametrize("exercise", [FLOPS, FIT, OPT])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail
