"""Numbers a notebook prints that come out the same on every CPU.

A float32 rounding error (2.4e-07 on one CPU, 3.1e-07 on another) or a figure that training
produced differs from machine to machine; the claim it supports does not. These helpers
check the claim and return the text to print, so what is printed is always what was checked:

    print(f"largest difference from PyTorch: {below(error, 1e-6)}")      # "below 1e-6", or AssertionError
    print(f"accuracy {between(accuracy, 0.4, 0.7, '{:.0%}')}")            # "between 40% and 70%"
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


def below(value: float, bound: float) -> str:
    """Check ``value < bound`` (an error, a gap, a difference); return ``'below <bound>'``."""
    _check(value < bound, value, f"below {bound!r}")
    return f"below {_plain(bound)}"


def above(value: float, bound: float, fmt: str = "") -> str:
    """Check ``value > bound``; return ``'above <bound>'``, the bound formatted with ``fmt`` (e.g. ``'{:.0%}'``)."""
    _check(value > bound, value, f"above {bound!r}")
    return f"above {fmt.format(bound) if fmt else _plain(bound)}"


def between(value: float, low: float, high: float, fmt: str = "") -> str:
    """Check ``low <= value <= high``; return ``'between <low> and <high>'``, formatted with ``fmt``."""
    if not low < high:
        raise ValueError(f"low must be below high, got low={low!r}, high={high!r}")
    _check(low <= value <= high, value, f"between {low!r} and {high!r}")
    show = fmt.format if fmt else _plain
    return f"between {show(low)} and {show(high)}"
