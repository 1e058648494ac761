"""Chapter 10's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with ONE
planted bug. Every bug must fail exactly the tests documented to target it (the comment at the top of each
cell), and correct alternative implementations must pass everything. The hidden tests' oracles are synthetic
losses of known (E, A, alpha), among them losses with noise that only a log-space fit cannot see
(checks.planted_noise_losses), IsoFLOP runs of a known loss surface whose optimum is known in closed form
(checks.surface_runs), section 4's three-run windows of the shipped runs against the closed-form vertex
(checks.three_point_vertex), exact parabolas in log n (checks.parabola_runs), runs symmetric about their middle
one (checks.symmetric_runs), and 6ND = C and D = rN.
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

FLOPS, FIT, ISO, OPT = "training_flops", "fit_power_law", "isoflop_analysis", "compute_optimal"
SIX = "return 6.0 * n_params * n_tokens"
SSE = "sse = float(np.sum((np.log(loss) - np.log(fitted)) ** 2))"
LOG_N = "curvature, slope, _ = np.polyfit(np.log(n), loss, 2)"
VERTEX = "n_opt = math.exp(-slope / (2 * curvature))"
D_OPT = "optima[flops] = (float(n_opt), float(flops / (6 * n_opt)))"
EXPONENTS = "a = np.polyfit(log_c, np.log([n for n, _ in optima.values()]), 1)[0]"
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

LINEAR_EXPONENTS = """
    budget = np.array([float(flops) for flops in optima])

    def linear_fit(y):  # least squares on N_opt = k C^a itself: a on a grid, k in closed form
        grid = np.linspace(0.0, 1.5, 150_001)
        x = budget[None, :] ** grid[:, None]  # (grid, budgets)
        k = (x @ y) / (x * x).sum(1)
        return grid[((y[None, :] - k[:, None] * x) ** 2).sum(1).argmin()]

    a = linear_fit(np.array([n for n, _ in optima.values()]))"""

WINDOW = '''
def isoflop_analysis(budgets):
    if len(budgets) < 2:
        raise ValueError("need two budgets")
    optima = {}
    for flops, (n, loss) in budgets.items():
        if len(n) < 3:
            raise ValueError(f"budget {flops:g}: need three runs")
        order = np.argsort(n)
        n, loss = np.asarray(n, dtype=float)[order], np.asarray(loss, dtype=float)[order]
        i = min(max(int(loss.argmin()), 1), len(n) - 2)  # the lowest run and its neighbours, inside the sizes
        p = np.polyfit(np.log(n[i - 1:i + 2]), loss[i - 1:i + 2], 2)
        if p[0] <= 0:
            raise ValueError(f"budget {flops:g}: opens downward")
        n_opt = math.exp(-p[1] / (2 * p[0]))
        optima[flops] = (n_opt, flops / (6 * n_opt))
    a = np.polyfit(np.log(list(optima)), np.log([v[0] for v in optima.values()]), 1)[0]
    return a, 1 - a, optima
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
    # the IsoFLOP analysis
    (ISO, "parabola against n, not log n", mutate(ISO, (LOG_N, "curvature, slope, _ = np.polyfit(n, loss, 2)"),
                                                  (VERTEX, "n_opt = -slope / (2 * curvature)")),
     {f"{ISO}-visible", f"{ISO}-surface", f"{ISO}-shipped"}),  # `identity` holds: 6ND = C and a + b = 1 whatever the vertex
    (ISO, "the best run's size instead of the parabola's minimum", mutate(ISO, (VERTEX, "n_opt = n[int(loss.argmin())]")),
     {f"{ISO}-visible", f"{ISO}-surface", f"{ISO}-shipped"}),
    (ISO, "D_opt = C / N, the 6 forgotten", mutate(ISO, (D_OPT, "optima[flops] = (float(n_opt), float(flops / n_opt))")),
     {f"{ISO}-visible", f"{ISO}-identity"}),
    (ISO, "the exponent of N_opt fitted in linear space", mutate(ISO, (EXPONENTS, LINEAR_EXPONENTS.strip("\n").lstrip())),
     {f"{ISO}-shipped", f"{ISO}-identity"}),  # a + b = 1 holds only for lines fitted in log space
    (ISO, "no check of the curvature", mutate(ISO, ("if curvature <= 0:", "if False:")), {f"{ISO}-errors"}),
    # two runs: the least-squares "parabola" is not determined; when it opens upward an optimum comes back silently
    (ISO, "no check of the number of runs", mutate(ISO, ("if len(n) < 3:", "if False:")), {f"{ISO}-errors"}),
    # a parabola through other runs than the contract allows: within 3% on the loss surfaces, wrong on symmetric runs
    (ISO, "a parabola through the three smallest runs", WINDOW.replace("i = min(max(int(loss.argmin()), 1), len(n) - 2)", "i = 1"),
     {f"{ISO}-visible", f"{ISO}-shipped"}),
    (ISO, "a parabola through the lowest run and the two larger ones",
     WINDOW.replace("i = min(max(int(loss.argmin()), 1), len(n) - 2)", "i = min(int(loss.argmin()), len(n) - 3) + 1"),
     {f"{ISO}-visible", f"{ISO}-shipped"}),
    (ISO, "correct: section 4's window inside the function (the lowest run and its two neighbours)", WINDOW, set()),
    (ISO, "correct: a vertex outside the sizes trained refused", mutate(ISO, (VERTEX, VERTEX + """
        if not n.min() <= n_opt <= n.max():
            raise ValueError(f"budget {flops:g}: the vertex N = {n_opt:g} lies outside the sizes trained")""")), set()),
    (ISO, "correct: the vertex by numpy.polynomial, exponents by lstsq, b as 1 - a", '''
def isoflop_analysis(budgets):
    if len(budgets) < 2:
        raise ValueError("need two budgets")
    optima = {}
    for flops, (n, loss) in budgets.items():
        if len(n) < 3:
            raise ValueError("need three runs")
        p = np.polynomial.Polynomial.fit(np.log(n), loss, 2).convert()
        if p.coef[2] <= 0:
            raise ValueError("opens downward")
        n_opt = math.exp(-p.coef[1] / (2 * p.coef[2]))
        optima[flops] = (n_opt, flops / 6 / n_opt)
    X = np.stack([np.ones(len(optima)), np.log(list(optima))], axis=1)
    a = np.linalg.lstsq(X, np.log([n for n, _ in optima.values()]), rcond=None)[0][1]
    return a, 1 - a, optima
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
    # numbers that compare as anything (what the hidden tests compute from them is always within tolerance)
    (FIT, "look-alike numbers, not floats", '''
class Anything:
    def __sub__(self, other):
        return self
    def __truediv__(self, other):
        return self
    def __abs__(self):
        return 0.0
    def __float__(self):
        return float("nan")
def fit_power_law(n, loss, offsets=None):
    return Anything(), Anything(), Anything()
''', {f"{FIT}-visible", f"{FIT}-offset", f"{FIT}-logspace"}),
    (OPT, "correct: D first", '''
def compute_optimal(flops, tokens_per_param=20.0):
    n_tokens = (flops * tokens_per_param / 6) ** 0.5
    return n_tokens / tokens_per_param, n_tokens
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {FLOPS, FIT, ISO, OPT}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) == (5 if exercise == ISO else 3)


@pytest.mark.parametrize("exercise", [FLOPS, FIT, ISO, OPT])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail
