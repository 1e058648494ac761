"""The number beside the claim: a notebook prints what it measured and the claim it checked.

A float32 rounding error (2.4e-07 on one CPU, 3.1e-07 on another) or a figure that training
produced differs from machine to machine; the claim it supports does not. These helpers
check the claim and return the text to print: the measured value, then the checked claim,

    print(f"largest difference from PyTorch: {below(error, 1e-6)}")   # "2.4e-07, checked: below 1e-6"
    print(f"accuracy {between(accuracy, 0.4, 0.7, '{:.0%}')}")         # "55%, checked: between 40% and 70%"

so the learner sees their own figure, and a false claim stops the notebook (AssertionError). nbval's
sanitizer (tests/nbval_sanitize.cfg, ``[measured]``) masks the part before ", checked:", so the
stored outputs stay identical on any CPU.
"""
from __future__ import annotations

import math


def _plain(number: float) -> str:
    """1e-06 -> '1e-6', 0.001 -> '0.001', 5e-05 -> '5e-5'."""
    if number != 0 and (abs(number) < 1e-3 or abs(number) >= 1e6):
        mantissa, exponent = f"{number:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{number:g}"


def _check(ok: bool, value: float, claim: str) -> None:
    if not (ok and math.isfinite(value)):
        raise AssertionError(f"expected a value {claim}, got {value!r}")


def _measured(value: float, fmt: str) -> str:
    """The measured value as printed beside its claim: with ``fmt`` if given, else 3 significant figures."""
    if fmt:
        return fmt.format(value)
    text = f"{value:.3g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text


#: What separates the measured value from the claim; nbval's sanitizer masks what comes before it.
CHECKED = ", checked: "


def below(value: float, bound: float, fmt: str = "") -> str:
    """Check ``value < bound`` (an error, a gap, a difference); return ``'<value>, checked: below <bound>'``."""
    _check(value < bound, value, f"below {bound!r}")
    return f"{_measured(value, fmt)}{CHECKED}below {fmt.format(bound) if fmt else _plain(bound)}"


def above(value: float, bound: float, fmt: str = "") -> str:
    """Check ``value > bound``; return ``'<value>, checked: above <bound>'``, formatted with ``fmt`` (e.g. ``'{:.0%}'``)."""
    _check(value > bound, value, f"above {bound!r}")
    return f"{_measured(value, fmt)}{CHECKED}above {fmt.format(bound) if fmt else _plain(bound)}"


def between(value: float, low: float, high: float, fmt: str = "") -> str:
    """Check ``low <= value <= high``; return ``'<value>, checked: between <low> and <high>'``, formatted with ``fmt``."""
    if not low < high:
        raise ValueError(f"low must be below high, got low={low!r}, high={high!r}")
    _check(low <= value <= high, value, f"between {low!r} and {high!r}")
    show = fmt.format if fmt else _plain
    return f"{_measured(value, fmt)}{CHECKED}between {show(low)} and {show(high)}"
