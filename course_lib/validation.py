"""Argument checks the library shares: a bad argument gets a ValueError that names it and says what is allowed."""
from __future__ import annotations


def is_count(value) -> bool:
    """A Python int that is not a bool (True is an int in Python, but not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive(name: str, value, *, optional: bool = False) -> None:
    """ValueError naming ``name`` unless ``value`` is an integer >= 1 (or None, when ``optional``)."""
    if optional and value is None:
        return
    if not is_count(value) or value < 1:
        allowed = "None or an integer >= 1" if optional else "an integer >= 1"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
