"""Chapter 10's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import math

import numpy as np
import pytest

from course_lib import checks
from course_lib.scaling import compute_optimal, fit_power_law, training_flops


def test_reference_implementations_pass_every_visible_check(capsys):
    checks.check_training_flops(training_flops)
    checks.check_fit_power_law(fit_power_law)
    checks.check_compute_optimal(compute_optimal)
    assert capsys.readouterr().out.count("all visible checks passed") == 3


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


def forgot_six(flops, tokens_per_param=20.0):
    n = math.sqrt(flops / tokens_per_param)
    return n, tokens_per_param * n


def ratio_inverted(flops, tokens_per_param=20.0):
    n = math.sqrt(flops * tokens_per_param / 6)
    return n, n / tokens_per_param


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_training_flops, forward_only, r"= 2ND: that is the forward pass only\. The backward pass costs twice"),
    (checks.check_training_flops, not_proportional, r"training_flops\(2,000, 2,000\) should be 24,000,000.*in proportion to N and to D"),
    (checks.check_training_flops, scalars_only, r"training_flops should work elementwise on numpy arrays: .* it raised TypeError"),
    (checks.check_fit_power_law, no_offset, r"you returned E = 0 and alpha = .*did you fit log\(loss\) against log\(n\)\?"),
    (checks.check_fit_power_law, returns_a_list, r"should return a tuple \(E, A, alpha\), got list"),
    (checks.check_fit_power_law, coarse_default, r"with the default offsets \(1000 values in \[0, min\(loss\)\)"),
    (checks.check_compute_optimal, forgot_six, r"got 6 N D = 7\.2e\+14 \(did you forget the 6 of C = 6ND\?\)"),
    (checks.check_compute_optimal, ratio_inverted, r"D / N should be 20, got 0\.05"),
])
def test_classic_bugs_get_specific_messages(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)
