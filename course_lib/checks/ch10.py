"""Visible checks of chapter 10 (scaling laws), and the independent oracles they compare against.

Oracles: numbers worked out by hand (6 x 1,000 x 2,000 = 12,000,000), synthetic losses made from a known
(E, A, alpha) (``synthetic_losses``, ``planted_noise_losses``), IsoFLOP runs of a known loss surface
L(N, D) = E + A/N^alpha + B/D^beta whose optimum is known in closed form (``surface_runs``, ``surface_optimum``),
and the defining equations of the compute-optimal split (6ND = C, D = rN) checked on what the learner returns;
never course_lib.scaling's reference solutions.
"""
from __future__ import annotations

import math

import numpy as np

from .core import fail, passed

__all__ = ["check_training_flops", "check_fit_power_law", "check_isoflop_analysis", "check_compute_optimal",
           "synthetic_losses", "planted_noise_losses", "surface_runs", "surface_optimum", "shipped_isoflop_runs",
           "shipped_isoflop_windows", "parabola_runs", "symmetric_runs", "three_point_vertex"]


def synthetic_losses(n, E: float, A: float, alpha: float):
    """Exact losses E + A / n**alpha (float64) of a known power law: the oracle of the fitting checks."""
    return E + A / np.asarray(n, dtype=np.float64) ** alpha


def planted_noise_losses(n, E: float, A: float, alpha: float, noise0):
    """Losses E + A n^-alpha exp(eps) whose noise eps the fit in log space cannot see.

    eps is noise0 made orthogonal to 1 and log n, so that at the true E the least-squares line through
    log(loss - E) is the true one, log A - alpha log n; then it is moved along one more direction orthogonal to
    both (a secant search) until the sum of squared residuals of log(loss) is stationary in E at the true E.
    A fit that compares the candidate offsets by the residuals of log(loss) keeps the true (E, A, alpha); one
    that compares them on another scale (the residuals of log(loss - E), or of the losses themselves) sees a
    slope there and moves away. Returns (loss (P,), eps (P,)).
    """
    n = np.asarray(n, dtype=np.float64)
    law = A * n**-alpha  # (P,): the true losses less E
    basis, _ = np.linalg.qr(np.stack([np.ones_like(n), np.log(n)], axis=1))  # (P, 2): the lines in log n

    def line_part(x):
        return basis @ (basis.T @ x)

    def residual_and_change(eps):
        """The residuals of log(loss) at the true law (P,), and their derivative in E (P,): E and the line both move."""
        loss = E + law * np.exp(eps)
        return np.log(loss) - np.log(E + law), -(1 - law * line_part(1 / (loss - E))) / (E + law)

    def slope(eps) -> float:  # half the derivative in E of the sum of squared residuals of log(loss), at the true E
        residual, change = residual_and_change(eps)
        return float(residual @ change)

    eps = np.asarray(noise0, dtype=np.float64)
    eps = eps - line_part(eps)
    direction = law / (E + law) * residual_and_change(eps)[1]  # (P,): moves the residuals along their change
    direction = direction - line_part(direction)
    direction /= np.linalg.norm(direction)
    (c0, f0), c1 = (0.0, slope(eps)), 1e-3
    for _ in range(100):  # the secant method on slope(eps + c direction) = 0
        f1 = slope(eps + c1 * direction)
        if abs(f1) < 1e-15 or f1 == f0:
            break
        (c0, f0), c1 = (c1, f1), c1 - f1 * (c1 - c0) / (f1 - f0)
    eps = eps + c1 * direction
    if abs(slope(eps)) > 1e-12:
        raise ValueError(f"no noise near {list(noise0)} makes the log-space fit stationary at E = {E}")
    return E + law * np.exp(eps), eps


def _number(value, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        fail(f"{what} should be a number, got {type(value).__name__}")
    if not math.isfinite(number):
        fail(f"{what} should be finite, got {number}")
    return number


def check_training_flops(training_flops) -> None:
    """Visible checks for chapter 10, exercise 1: C = 6ND on small numbers, linear in N and in D, elementwise on
    arrays, and without integer overflow on int64 arrays of real sizes (GPT-3's 175e9 parameters, 300e9 tokens)."""
    got = _number(training_flops(1_000, 2_000), "training_flops(1_000, 2_000)")
    if got == 2 * 1_000 * 2_000:
        fail("training_flops(1_000, 2_000) = 4,000,000 = 2ND: that is the forward pass only. The backward pass costs "
             "twice the forward (gradients for the activations and for the weights): 6ND in all")
    if abs(got - 12_000_000) > 1e-6:
        fail(f"training_flops(1_000, 2_000) should be 6 x 1,000 x 2,000 = 12,000,000, got {got:,.6g}")
    for n, d in ((2_000, 2_000), (1_000, 6_000)):
        value = _number(training_flops(n, d), f"training_flops({n:,}, {d:,})")
        if abs(value - 6 * n * d) > 1e-6:
            fail(f"training_flops({n:,}, {d:,}) should be {6 * n * d:,}, got {value:,.6g}: C grows in proportion to N and to D")
    try:
        arrays = np.asarray(training_flops(np.array([1e3, 1e4]), np.array([2e3, 2e5])), dtype=np.float64)
    except Exception as error:  # noqa: BLE001 - any error is the learner's to see, with its cause
        fail(f"training_flops should work elementwise on numpy arrays: for N = [1e3, 1e4] and D = [2e3, 2e5] it raised "
             f"{type(error).__name__}: {error}")
    if arrays.shape != (2,) or not np.allclose(arrays, [1.2e7, 1.2e10], rtol=1e-12, atol=0):
        fail(f"training_flops should work elementwise on numpy arrays: for N = [1e3, 1e4] and D = [2e3, 2e5] expected "
             f"[1.2e7, 1.2e10], got {arrays.tolist()}")
    n_big, d_big = np.array([175_000_000_000], dtype=np.int64), np.array([300_000_000_000], dtype=np.int64)  # GPT-3
    with np.errstate(over="ignore"):
        got = np.asarray(training_flops(n_big, d_big))
        wrapped = int((np.int64(6) * n_big * d_big)[0])
    if got.shape != (1,) or not np.allclose(got.astype(np.float64), [3.15e23], rtol=1e-12, atol=0):
        value = got.ravel()[0] if got.size else got
        hint = ""
        overflow = ("6 x 175e9 x 300e9 = 3.15e23 is far beyond the int64 limit 2^63 = 9.2e18, so it wrapped around "
                    "without a warning")
        if not np.issubdtype(got.dtype, np.floating):
            hint = (f": the product was computed in {got.dtype} arithmetic, and {overflow} (to {wrapped:,}). Compute in "
                    "floating point: 6.0 * n_params * n_tokens")
        elif got.size == 1 and int(value) == wrapped:
            hint = (f": the integers were multiplied first and converted afterwards (Python multiplies left to right: "
                    f"n * d * 6.0 multiplies the integers first), and {overflow} (to {wrapped:,}). Put the float "
                    "first: 6.0 * n_params * n_tokens")
        elif got.dtype != np.float64:
            hint = (f": the result is {got.dtype}, which keeps about {np.finfo(got.dtype).precision} significant digits; "
                    "compute in float64 (Python floats, numpy's default)")
        fail(f"training_flops(N, D) for int64 arrays N = [175e9], D = [300e9] (GPT-3's size) should be [3.15e23], got "
             f"{got.tolist()}{hint}")
    passed("training_flops")


def _fit(fit_power_law, n, loss, offsets, what: str):
    result = fit_power_law(n, loss, offsets) if offsets is not None else fit_power_law(n, loss)
    if not isinstance(result, tuple) or len(result) != 3:
        fail(f"fit_power_law should return a tuple (E, A, alpha), got {type(result).__name__} ({what})")
    return tuple(_number(v, f"{name} ({what})") for v, name in zip(result, ("E", "A", "alpha")))


def _offset_chosen_by(n, loss, offsets, scale: str):
    """The (E, A, alpha) a fit gets when it compares the candidate offsets on the wrong `scale`: "line" (the residuals
    of each E's own line, in log(loss - E)) or "loss" (the residuals of the losses themselves, in linear space)."""
    X = np.stack([np.ones_like(n), -np.log(n)], axis=1)
    best = None
    for E in offsets:
        coef = np.linalg.lstsq(X, np.log(loss - E), rcond=None)[0]
        law = E + np.exp(X @ coef)
        score = np.sum((X @ coef - np.log(loss - E)) ** 2) if scale == "line" else np.sum((loss - law) ** 2)
        if best is None or score < best[0]:
            best = (score, float(E), float(np.exp(coef[0])), float(coef[1]))
    return best[1:]


def check_fit_power_law(fit_power_law) -> None:
    """Visible checks for chapter 10, exercise 2: known power laws recovered, with and without an offset grid, and
    noisy losses whose noise only the comparison of the offsets in log(loss) cannot see."""
    n = np.logspace(3, 6, 7)
    E, A, alpha = 1.5, 20.0, 0.5
    loss = synthetic_losses(n, E, A, alpha)
    offsets = np.round(np.arange(0, 1_501) * 0.001, 3)  # 0, 0.001, ..., 1.5: the true E is one of them
    got_E, got_A, got_alpha = _fit(fit_power_law, n, loss, offsets, "offsets 0, 0.001, ..., 1.5")
    if got_E == 0.0 and abs(got_alpha - alpha) > 0.01:
        fail(f"for losses 1.5 + 20 / n^0.5 you returned E = 0 and alpha = {got_alpha:.4g}: did you fit log(loss) against "
             "log(n)? The loss does not fall to 0 but to E: fit log(loss - E) for each candidate E in offsets")
    if abs(got_E - E) > 1e-9 or abs(got_alpha - alpha) > 1e-6 or abs(got_A - A) > 1e-4:
        fail(f"for exact losses 1.5 + 20 / n^0.5 (n = 1e3 ... 1e6) and an offsets grid that holds 1.5, expected "
             f"(E, A, alpha) = (1.5, 20, 0.5), got ({got_E:.6g}, {got_A:.6g}, {got_alpha:.6g})")
    got_E, got_A, got_alpha = _fit(fit_power_law, n, loss, None, "default offsets")
    if abs(got_alpha - alpha) > 0.01 or abs(got_E - E) > 0.01:
        fail(f"with the default offsets (1000 values in [0, min(loss)) = [0, {loss.min():.4g})) expected E close to 1.5 "
             f"and alpha close to 0.5 (within 0.01), got E = {got_E:.4g}, alpha = {got_alpha:.4g}")
    n = np.logspace(3, 7, 9)
    E, A, alpha = 0.8, 6.0, 0.3
    loss, _ = planted_noise_losses(n, E, A, alpha, [0.12, -0.15, 0.05, 0, 0.03, 0, 0, 0.1, -0.1])
    offsets = np.round(np.arange(0, 843) * 0.001, 3)  # 0, 0.001, ..., 0.842: below min(loss) = 0.843
    got_E, got_A, got_alpha = _fit(fit_power_law, n, loss, offsets, "noisy losses")
    if abs(got_E - E) > 0.002 or abs(got_alpha - alpha) > 0.005:
        what = (f"for noisy losses around 0.8 + 6 / n^0.3 (n = 1e3 ... 1e7; the noise is planted so that comparing the "
                f"offsets by the residuals of log(loss) keeps E = 0.8 and alpha = 0.3) you returned E = {got_E:.4g}, "
                f"alpha = {got_alpha:.4g}")
        one_scale = ("Compare every candidate E on one scale: the sum of squared residuals of log(loss), "
                     "log(loss) - log(E + A / n^alpha)")
        for scale, mistake in (
            ("line", "that is the offset whose own line fits best, in log(loss - E). That scale changes with E: a "
                     "misfit d of the loss is about d / (loss - E) there, so the closer E comes to the losses, the "
                     "larger the same misfit looks, and the comparison favours small E"),
            ("loss", "that is the offset whose law fits the losses themselves best, in linear space: the large losses "
                     "of the small models dominate that sum, and a power law's errors are relative"),
        ):
            wrong_E, _, wrong_alpha = _offset_chosen_by(n, loss, offsets, scale)
            if abs(got_E - wrong_E) < 1e-9 and abs(got_alpha - wrong_alpha) < 1e-6:
                fail(f"{what}: {mistake}. {one_scale}")
        fail(f"{what}, expected (0.8, 0.3): fit log(loss - E) = log A - alpha log n by least squares for each E (a fit "
             f"of the losses themselves, in linear space, lets the large losses dominate). {one_scale}")
    passed("fit_power_law")


def check_compute_optimal(compute_optimal) -> None:
    """Visible checks for chapter 10, exercise 4: 6ND = C and D = rN, on a worked example, at r = 20 and r = 120."""
    result = compute_optimal(1.2e14)
    if not isinstance(result, tuple) or len(result) != 2:
        fail(f"compute_optimal should return a tuple (N, D), got {type(result).__name__}")
    n, d = (_number(v, name) for v, name in zip(result, ("N", "D")))
    if n <= 0 or d <= 0:
        fail(f"N and D should be positive, got N = {n:.4g}, D = {d:.4g}")
    if abs(6 * n * d / 1.2e14 - 1) > 1e-9:
        hint = " (did you forget the 6 of C = 6ND?)" if abs(n * d / 1.2e14 - 1) < 1e-9 else ""
        fail(f"compute_optimal(1.2e14): 6 N D should spend the budget, 1.2e14 FLOPs; got 6 N D = {6 * n * d:.4g}{hint}")
    if abs(d / n - 20) > 1e-9:
        hint = (": that is 1 / 20, parameters per token. r counts tokens per parameter, D = r N (or are N and D swapped "
                "in the returned pair (N, D)?)" if abs(n / d - 20) < 1e-9 else "")
        fail(f"compute_optimal(1.2e14) with the default 20 tokens per parameter: D / N should be 20, got {d / n:.4g}{hint}")
    if abs(n - 1e6) > 1e-3:
        fail(f"compute_optimal(1.2e14) should give N = sqrt(1.2e14 / (6 x 20)) = 1e6 parameters, got {n:.6g}")
    result = compute_optimal(1.2e14, 120.0)
    if not isinstance(result, tuple) or len(result) != 2:
        fail(f"compute_optimal(1.2e14, 120.0) should return a tuple (N, D), got {type(result).__name__}")
    n, d = (_number(v, name) for v, name in zip(result, ("N", "D")))
    if abs(d / n - 20) < 1e-9:
        fail("compute_optimal(1.2e14, tokens_per_param=120.0) returned D / N = 20: you used 20 whatever the ratio "
             "given; use tokens_per_param (r) in N = sqrt(C / (6 r)) and D = r N")
    if abs(d / n - 120) > 1e-9 or abs(6 * n * d / 1.2e14 - 1) > 1e-9:
        if isinstance(result[0], int) or isinstance(result[1], int):
            fail(f"compute_optimal(1.2e14, tokens_per_param=120.0) returned whole numbers, N = {result[0]!r} and D = "
                 f"{result[1]!r}: rounding them breaks 6ND = C and D = 120 N (N = sqrt(1.2e14 / 720) = 408,248.29...). "
                 "Return the floats; round only where you print them")
        fail(f"compute_optimal(1.2e14, tokens_per_param=120.0) should give N = sqrt(1.2e14 / (6 x 120)) = 408,248 and "
             f"D = 120 N = 48,989,795 (D / N = 120, 6ND = C), got N = {n:,.6g}, D = {d:,.6g}")
    passed("compute_optimal")


def surface_optimum(flops, A: float, alpha: float, B: float, beta: float) -> float:
    """The exact loss-optimal N of L(N, D) = E + A/N^alpha + B/D^beta with 6ND = flops (Hoffmann et al. 2022, eq. 4):
    G (C/6)^(beta/(alpha+beta)), G = (alpha A / (beta B))^(1/(alpha+beta)); the oracle of the IsoFLOP checks."""
    return (alpha * A / (beta * B)) ** (1 / (alpha + beta)) * (flops / 6) ** (beta / (alpha + beta))


def surface_runs(budgets, E: float, A: float, alpha: float, B: float, beta: float, offsets):
    """IsoFLOP runs of the loss surface L(N, D) = E + A/N^alpha + B/D^beta: for each budget C, the sizes
    n = N_opt(C) exp(offsets) (offsets (P,), in log n from the exact optimum) trained on D = C / 6n tokens, and their
    exact losses (float64). Returns {C: (n (P,), loss (P,))}. The surface is not a parabola in log n, but it is the
    same curve at every budget up to a scale, so a parabola's vertex misses N_opt by the same factor at every
    budget and the fitted exponents are exact."""
    runs = {}
    for flops in budgets:
        n = surface_optimum(flops, A, alpha, B, beta) * np.exp(np.asarray(offsets, dtype=np.float64))
        runs[flops] = (n, E + A / n**alpha + B / (flops / (6 * n)) ** beta)
    return runs


def shipped_isoflop_runs() -> dict:
    """The shipped IsoFLOP runs (course_lib/assets/scaling-family.json): {C: (n (P,) non-embedding, val_loss (P,))},
    each budget's runs smallest first."""
    from ..scaling import load_results  # the data file, not a reference solution

    results = load_results()
    runs = {}
    for budget in results["recipe"]["isoflop_budgets"]:
        group = sorted((r for r in results["runs"] if r["group"] == f"isoflop-{budget:.0e}"), key=lambda r: r["non_embedding"])
        runs[float(budget)] = tuple(np.array([r[key] for r in group], dtype=np.float64) for key in ("non_embedding", "val_loss"))
    return runs


def shipped_isoflop_windows() -> dict:
    """Section 4's windows of the shipped runs: for each budget whose lowest loss is not at its smallest or largest size,
    that run and its two neighbours in size, {C: (n (3,), loss (3,))}; a budget whose lowest loss is at an end is left
    out (its runs do not bracket a minimum)."""
    windows = {}
    for flops, (n, loss) in shipped_isoflop_runs().items():
        i = int(loss.argmin())
        if 0 < i < len(n) - 1:
            windows[flops] = (n[i - 1:i + 2], loss[i - 1:i + 2])
    return windows


def three_point_vertex(n, loss) -> float:
    """The N of the lowest point of the parabola in log n through three runs (n (3,), loss (3,)), by the closed form
    for the vertex of the parabola through three points (no least squares: three points fix it)."""
    (x0, x1, x2), (y0, y1, y2) = np.log(np.asarray(n, dtype=np.float64)), np.asarray(loss, dtype=np.float64)
    numerator = (x1 - x0) ** 2 * (y1 - y2) - (x1 - x2) ** 2 * (y1 - y0)
    denominator = (x1 - x0) * (y1 - y2) - (x1 - x2) * (y1 - y0)
    return math.exp(x1 - 0.5 * numerator / denominator)


def parabola_runs(vertices: dict, offsets, curvature: float = 0.3, floor: float = 2.0) -> dict:
    """IsoFLOP runs that lie exactly on a parabola in log n: {C: N_opt} -> {C: (n (P,), loss (P,))}, the sizes
    n = N_opt exp(offsets) with losses floor + curvature (log n - log N_opt)^2. Every least-squares parabola through
    three or more of a budget's runs, the whole curve or the lowest run and its neighbours, has its vertex at N_opt."""
    runs = {}
    for flops, n_opt in vertices.items():
        offsets = np.asarray(offsets, dtype=np.float64)
        runs[flops] = (n_opt * np.exp(offsets), floor + curvature * offsets**2)
    return runs


def symmetric_runs(centres: dict, step: float = 0.5, sizes: int = 7) -> dict:
    """IsoFLOP runs symmetric in log n about their middle run but not on a parabola: {C: N_mid} -> {C: (n (sizes,),
    loss (sizes,))}, n = N_mid exp(step k) for k = -(sizes // 2) .. sizes // 2 (sizes odd), smallest first, losses
    2 + 0.1 x^2 + 0.08 x^4 with x = log(n / N_mid). The least-squares parabola through all of them and the one
    through the lowest run and its two neighbours have their vertex at N_mid (the fit of an even curve on points
    symmetric about 0 has no odd term); one through three runs at one end, or the lowest and two on one side, does not."""
    if sizes < 3 or sizes % 2 == 0:
        raise ValueError(f"sizes must be odd and at least 3, got {sizes}")
    x = step * np.arange(-(sizes // 2), sizes // 2 + 1, dtype=np.float64)
    return {flops: (n_mid * np.exp(x), 2.0 + 0.1 * x**2 + 0.08 * x**4) for flops, n_mid in centres.items()}


def _vertex(x, loss) -> float:
    curvature, slope, _ = np.polyfit(x, loss, 2)
    return -slope / (2 * curvature)


def check_isoflop_analysis(isoflop_analysis) -> None:
    """Visible checks for chapter 10, exercise 3: IsoFLOP runs of Chinchilla's loss surface (E, A, alpha, B, beta =
    1.69, 406.4, 0.34, 410.7, 0.28) at 4 budgets, 1e18 to 1e21 FLOPs, 7 sizes each: the optima within 3% of the
    surface's exact N_opt, 6 N_opt D_opt = C, and the exponents beta/(alpha+beta) and alpha/(alpha+beta) within 1e-4;
    and runs symmetric about their middle one (symmetric_runs): the vertex there, which three runs at one end miss."""
    A, alpha, B, beta = 406.4, 0.34, 410.7, 0.28
    offsets = np.arange(-1.3, 1.8, 0.5)  # log n from the exact optimum: the best run is 0.2 off it, exp(0.2) = 1.22
    budgets = [1e18, 1e19, 1e20, 1e21]
    runs = surface_runs(budgets, 1.69, A, alpha, B, beta, offsets)
    result = isoflop_analysis(runs)
    if not isinstance(result, tuple) or len(result) != 3:
        fail(f"isoflop_analysis should return a tuple (a, b, optima), got {type(result).__name__}")
    a, b = (_number(v, name) for v, name in zip(result[:2], ("a", "b")))
    optima = result[2]
    if not isinstance(optima, dict) or sorted(map(float, optima)) != budgets:
        fail(f"optima should be a dict with one entry per budget, {budgets}, got {optima!r:.200}")
    for flops in budgets:
        n_opt, d_opt = (_number(v, f"optima[{flops:g}][{i}]") for i, v in enumerate(optima[flops]))
        n, loss = runs[flops]
        exact = surface_optimum(flops, A, alpha, B, beta)
        if abs(n_opt / exact - 1) > 0.03:
            what = (f"budget {flops:g}: the surface's optimum is N = {exact:,.0f} (runs at {n.min():,.0f} to "
                    f"{n.max():,.0f}), you returned N_opt = {n_opt:,.6g}")
            if abs(n_opt - n[loss.argmin()]) <= 1e-9 * n_opt:
                fail(f"{what}: that is the best run's size. N_opt is the vertex of the parabola fitted to the budget's "
                     "runs against log n, in general not a size trained")
            if abs(n_opt / _vertex(n, loss) - 1) < 1e-6:
                fail(f"{what}: that is the vertex of a parabola in n. Fit the parabola against log n (the sizes span "
                     "orders of magnitude, and an IsoFLOP curve is a parabola in log n), then undo the log")
            if abs(n_opt / _vertex(np.log(n), loss) - 1) < 1e-6:
                fail(f"{what}: that is the vertex in log n itself; N_opt is a size: exp of the vertex")
            fail(f"{what}: fit loss against log n by a parabola (np.polyfit with degree 2) and take its minimum")
        if abs(6 * n_opt * d_opt / flops - 1) > 1e-9:
            hint = (" (did you compute D = C / N? Training costs 6 FLOPs per parameter and token: C = 6ND)"
                    if abs(n_opt * d_opt / flops - 1) < 1e-9 else "")
            fail(f"budget {flops:g}: D_opt should spend the budget, 6 N_opt D_opt = C; got 6 N_opt D_opt = "
                 f"{6 * n_opt * d_opt:.6g}{hint}")
    centres = {1e12: 3e4, 1e13: 1e5}
    symmetric = symmetric_runs(centres)
    got = isoflop_analysis(symmetric)[2]
    for flops, n_mid in centres.items():
        n_opt = _number(got[flops][0], f"optima[{flops:g}][0]")
        if abs(n_opt / n_mid - 1) > 1e-6:
            n, loss = symmetric[flops]
            fail(f"budget {flops:g}: 7 runs symmetric in log n about the middle one, N = {n_mid:,.0f} (losses "
                 f"{', '.join(f'{v:.3f}' for v in loss)}): the parabola through all of them, and the one through the "
                 f"lowest run and its two neighbours in size, both have their vertex there; you returned {n_opt:,.6g}. "
                 "Fit all the runs, or the lowest one and its two neighbours, not three runs at one end or on one side")
    if abs(a - beta / (alpha + beta)) > 1e-4 or abs(b - alpha / (alpha + beta)) > 1e-4:
        fail(f"the surface's optima grow as N_opt ~ C^{beta / (alpha + beta):.4f} and D_opt ~ C^{alpha / (alpha + beta):.4f} "
             f"(beta/(alpha+beta) and alpha/(alpha+beta)), you returned a = {a:.6g}, b = {b:.6g}: fit straight lines to "
             "log N_opt and log D_opt against log C by least squares; their slopes are the exponents")
    passed("isoflop_analysis")
