"""Chapter 10's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import math

import numpy as np
import pytest

from course_lib import checks
from course_lib.scaling import fit_power_law, isoflop_analysis


def test_synthetic_losses_are_the_formula():
    assert np.allclose(checks.synthetic_losses([1.0, 100.0], 1.5, 20.0, 0.5), [21.5, 3.5])


def forward_only(n_params, n_tokens):
    return 2.0 * n_params * n_tokens


def not_proportional(n_params, n_tokens):
    return 6.0 * n_params * n_tokens if n_params == 1_000 and n_tokens == 2_000 else 6.0 * n_params + n_tokens


def scalars_only(n_params, n_tokens):
    return 6.0 * float(n_params) * float(n_tokens)


def no_offset(n, loss, offsets=None):
    slope, intercept = np.polyfit(np.log(n), np.log(loss), 1)
    return 0.0, float(np.exp(intercept)), float(-slope)


def returns_a_list(n, loss, offsets=None):
    return list(fit_power_law(n, loss, offsets))


def coarse_default(n, loss, offsets=None):  # a default grid of 10 values: too coarse
    return fit_power_law(n, loss, np.linspace(0, min(loss), 11)[:-1] if offsets is None else offsets)


def integer_arithmetic(n_params, n_tokens):
    return 6 * n_params * n_tokens  # int64 arrays wrap around 2^63


def _fit_comparing_by(score):
    def fit(n, loss, offsets=None):
        n, loss = np.asarray(n, dtype=np.float64), np.asarray(loss, dtype=np.float64)
        offsets = np.linspace(0.0, loss.min(), 1001)[:-1] if offsets is None else offsets
        X = np.stack([np.ones_like(n), -np.log(n)], axis=1)
        best = None
        for E in offsets:
            coef = np.linalg.lstsq(X, np.log(loss - E), rcond=None)[0]
            value = score(X @ coef, E, loss)
            if best is None or value < best[0]:
                best = (value, float(E), float(np.exp(coef[0])), float(coef[1]))
        return best[1:]
    return fit


own_line = _fit_comparing_by(lambda line, E, loss: np.sum((line - np.log(loss - E)) ** 2))
linear_residuals = _fit_comparing_by(lambda line, E, loss: np.sum((loss - E - np.exp(line)) ** 2))


def least_squares_in_linear_space(n, loss, offsets=None):
    """For each E, alpha on a grid and A in closed form, minimising the squared errors of the losses themselves."""
    n, loss = np.asarray(n, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    offsets = np.linspace(0.0, loss.min(), 1001)[:-1] if offsets is None else offsets
    alphas = np.linspace(0.01, 1.0, 991)
    x = n[None, :] ** -alphas[:, None]
    best = None
    for E in offsets:
        y = loss - E
        A = (x @ y) / (x * x).sum(1)
        sse = ((y[None, :] - A[:, None] * x) ** 2).sum(1)
        i = int(sse.argmin())
        if best is None or sse[i] < best[0]:
            best = (sse[i], float(E), float(A[i]), float(alphas[i]))
    return best[1:]


def float_last(n_params, n_tokens):
    return n_params * n_tokens * 6.0


def float32_arithmetic(n_params, n_tokens):
    return np.float32(6.0) * np.asarray(n_params, dtype=np.float32) * np.asarray(n_tokens, dtype=np.float32)


def whole_numbers(flops, tokens_per_param=20.0):
    n = math.sqrt(flops / (6 * tokens_per_param))
    return int(n), int(tokens_per_param * n)


def fixed_twenty(flops, tokens_per_param=20.0):
    n = math.sqrt(flops / (6 * 20))
    return n, 20 * n


def forgot_six(flops, tokens_per_param=20.0):
    n = math.sqrt(flops / tokens_per_param)
    return n, tokens_per_param * n


def ratio_inverted(flops, tokens_per_param=20.0):
    n = math.sqrt(flops * tokens_per_param / 6)
    return n, n / tokens_per_param


def test_surface_optimum_is_the_brute_force_minimum_of_the_surface():
    A, alpha, B, beta = 406.4, 0.34, 410.7, 0.28
    for flops in (1e18, 1e21):
        n = np.logspace(4, 12, 400_001)
        brute = n[np.argmin(A / n**alpha + B / (flops / (6 * n)) ** beta)]
        assert checks.surface_optimum(flops, A, alpha, B, beta) == pytest.approx(brute, rel=1e-4)


def test_surface_runs_spend_the_budget_and_sit_at_the_offsets():
    runs = checks.surface_runs([1e18], 1.69, 406.4, 0.34, 410.7, 0.28, [-1.0, 0.0, 1.0])
    n, loss = runs[1e18]
    assert np.allclose(np.log(n / checks.surface_optimum(1e18, 406.4, 0.34, 410.7, 0.28)), [-1.0, 0.0, 1.0])
    assert loss[1] < loss[0] and loss[1] < loss[2]  # the exact optimum is the lowest


def test_three_point_vertex_is_the_lowest_point_of_the_parabola_by_brute_force():
    n, loss = np.array([3e3, 7e3, 2e4]), np.array([2.1, 2.0, 2.3])
    p = np.linalg.solve(np.stack([np.log(n) ** 2, np.log(n), np.ones(3)], axis=1), loss)  # through the three points exactly
    x = np.linspace(math.log(3e3), math.log(2e4), 2_000_001)
    assert math.log(checks.three_point_vertex(n, loss)) == pytest.approx(x[np.argmin(np.polyval(p, x))], abs=1e-5)


def test_parabola_runs_lie_on_a_parabola_around_their_vertex():
    runs = checks.parabola_runs({1e12: 5e4, 1e13: 2e5}, [-1.0, 0.5, 2.0], curvature=0.2, floor=1.5)
    n, loss = runs[1e13]
    assert np.allclose(n, 2e5 * np.exp([-1.0, 0.5, 2.0])) and np.allclose(loss, 1.5 + 0.2 * np.log(n / 2e5) ** 2)


def test_shipped_windows_are_the_lowest_run_and_its_neighbours_where_the_runs_bracket_a_minimum():
    runs, windows = checks.shipped_isoflop_runs(), checks.shipped_isoflop_windows()
    assert list(windows) == [3e11, 1e12]  # at 1e11 the smallest size is the best: no window (section 4)
    assert int(runs[1e11][1].argmin()) == 0
    for flops, (n, loss) in windows.items():
        assert len(n) == 3 and loss[1] == runs[flops][1].min() and loss[1] < min(loss[0], loss[2])
        assert np.all(np.diff(n) > 0) and set(n) <= set(runs[flops][0])


def _analysis(vertex, d_of=lambda flops, n_opt: flops / (6 * n_opt)):
    """An IsoFLOP analysis with its own vertex (n, loss) -> N_opt and D_opt; exponents in log space."""
    def analysis(budgets):
        optima = {c: (vertex(np.asarray(n, float), np.asarray(loss, float)),) for c, (n, loss) in budgets.items()}
        optima = {c: (n_opt, d_of(c, n_opt)) for c, (n_opt,) in optima.items()}
        log_c = np.log(list(optima))
        return (np.polyfit(log_c, np.log([n for n, _ in optima.values()]), 1)[0],
                np.polyfit(log_c, np.log([d for _, d in optima.values()]), 1)[0], optima)
    return analysis


def _log_vertex(n, loss):
    p = np.polyfit(np.log(n), loss, 2)
    return math.exp(-p[1] / (2 * p[0]))


def _linear_vertex(n, loss):
    p = np.polyfit(n, loss, 2)
    return -p[1] / (2 * p[0])


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_isoflop_analysis, _analysis(_linear_vertex), r"that is the vertex of a parabola in n\. Fit the parabola against log n"),
    (checks.check_isoflop_analysis, _analysis(lambda n, loss: n[loss.argmin()]), r"that is the best run's size\. N_opt is the vertex of the parabola .*in general not a size trained"),
    (checks.check_isoflop_analysis, _analysis(lambda n, loss: math.log(_log_vertex(n, loss))), r"that is the vertex in log n itself"),
    (checks.check_isoflop_analysis, _analysis(_log_vertex, lambda flops, n_opt: flops / n_opt), r"did you compute D = C / N\?"),
    (checks.check_isoflop_analysis, lambda budgets: isoflop_analysis(budgets)[::-1], r"should return a tuple \(a, b, optima\), got|should be a number"),
    (checks.check_isoflop_analysis, lambda budgets: (0.5, 0.5, isoflop_analysis(budgets)[2]), r"you returned a = 0\.5, b = 0\.5: fit straight lines"),
    (checks.check_training_flops, forward_only, r"= 2ND: that is the forward pass only\. The backward pass costs twice"),
    (checks.check_training_flops, not_proportional, r"training_flops\(2,000, 2,000\) should be 24,000,000.*in proportion to N and to D"),
    (checks.check_training_flops, scalars_only, r"training_flops should work elementwise on numpy arrays: .* it raised TypeError"),
    (checks.check_training_flops, integer_arithmetic, (r"for int64 arrays N = \[175e9\], D = \[300e9\] .*computed in "
                                                       r"int64 arithmetic.*wrapped around without a warning")),
    (checks.check_training_flops, float_last, (r"the integers were multiplied first and converted afterwards \(Python "
                                               r"multiplies left to right.*wrapped around.*Put the float first")),
    (checks.check_training_flops, float32_arithmetic, r"the result is float32, .*compute in float64"),
    (checks.check_compute_optimal, whole_numbers, r"returned whole numbers, N = 408248 and D = 48989794: rounding them breaks"),
    (checks.check_fit_power_law, own_line, (r"noisy losses .*you returned E = 0, .*the offset whose own line fits best, "
                                            r"in log\(loss - E\).*favours small E")),
    (checks.check_fit_power_law, linear_residuals, (r"you returned E = 0.805, .*the offset whose law fits the losses "
                                                    r"themselves best, in linear space")),
    (checks.check_fit_power_law, least_squares_in_linear_space, (r"you returned E = 0.824, alpha = 0.335, expected "
                                                                 r"\(0.8, 0.3\): fit log\(loss - E\) .*by least squares")),
    (checks.check_compute_optimal, fixed_twenty, r"returned D / N = 20: you used 20 whatever the ratio given"),
    (checks.check_fit_power_law, no_offset, r"you returned E = 0 and alpha = .*did you fit log\(loss\) against log\(n\)\?"),
    (checks.check_fit_power_law, returns_a_list, r"should return a tuple \(E, A, alpha\), got list"),
    (checks.check_fit_power_law, coarse_default, r"with the default offsets \(1000 values in \[0, min\(loss\)\)"),
    (checks.check_compute_optimal, forgot_six, r"got 6 N D = 7\.2e\+14 \(did you forget the 6 of C = 6ND\?\)"),
    (checks.check_compute_optimal, ratio_inverted, r"D / N should be 20, got 0\.05: that is 1 / 20, parameters per token"),
])
def test_classic_bugs_get_specific_messages(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)


def test_symmetric_runs_put_both_accepted_vertices_at_the_middle_run_and_one_sided_ones_elsewhere():
    (n, loss), = checks.symmetric_runs({1e12: 3e4}).values()
    x = np.log(n / 3e4)
    assert len(n) == 7 and np.allclose(x, 0.5 * np.arange(-3, 4)) and np.allclose(loss, 2 + 0.1 * x**2 + 0.08 * x**4)
    assert _log_vertex(n, loss) == pytest.approx(3e4, rel=1e-9) and _log_vertex(n[2:5], loss[2:5]) == pytest.approx(3e4, rel=1e-9)
    for window in (slice(0, 3), slice(3, 6), slice(4, 7)):  # three at one end, the lowest and two on one side
        assert abs(_log_vertex(n[window], loss[window]) / 3e4 - 1) > 0.1


def _window(pick):
    """An IsoFLOP analysis fitting the parabola in log n to the runs pick(loss) -> slice chooses."""
    return _analysis(lambda n, loss: _log_vertex(n[pick(loss)], loss[pick(loss)]))


@pytest.mark.parametrize("buggy", [_window(lambda loss: slice(0, 3)), _window(lambda loss: slice(int(loss.argmin()), int(loss.argmin()) + 3))],
                         ids=["three smallest", "the lowest and two larger"])
def test_a_parabola_through_other_runs_than_the_contract_allows_is_named(buggy):
    """Both pass the loss surfaces (within 3%: 0.970 of the optimum for the three smallest) and every other visible case."""
    with pytest.raises(checks.CheckFailed, match=r"symmetric in log n about the middle one.*not three runs at one end or on one side"):
        checks.check_isoflop_analysis(buggy)
