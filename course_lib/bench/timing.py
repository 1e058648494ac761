"""Timing helpers of ``course bench``: contenders timed alternately after a warm-up, and a sleep to a point of a replay's
clock. ``threads`` (torch's thread count for a block) is the library's one, ``course_lib.kernels.threads``.

Set ``COURSE_TIMING_ROUNDS`` to a whole number N >= 1 to cap every ``alternate`` at N rounds, for a run that reads its
timings only through asserts that hold of N rounds as of more: nbval's run as on another CPU and the release runs
(tests/grading/test_release_runs.py) set 2, and the measurements that end a notebook, run as is, 1 (conftest.py).
Unset: as many rounds as each caller asks. (The kernel choices of ``course_lib.kernels`` keep their rounds: which
kernel wins decides what later timings run.)"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from typing import Callable, Hashable, Iterable

from ..kernels import threads  # noqa: F401 - the library's one; the benchmarks take it from here
from ..validation import check_positive


@dataclasses.dataclass
class Runs:
    """One contender's timed calls, a round each: what each returned and its seconds (``time.perf_counter``)."""
    results: list
    seconds: list[float]

    @property
    def median(self) -> float:
        """The median seconds of a call."""
        return statistics.median(self.seconds)


def rounds_cap() -> float:
    """The most rounds an ``alternate`` may time: COURSE_TIMING_ROUNDS, or no cap (inf) where it is unset (the
    module's docstring)."""
    cap = os.environ.get("COURSE_TIMING_ROUNDS")
    if cap is None:
        return math.inf
    if not (cap.isascii() and cap.isdigit()) or int(cap) < 1:
        raise ValueError(f"COURSE_TIMING_ROUNDS must be a whole number >= 1, got {cap!r}")
    return int(cap)


def alternate(contenders: dict[Hashable, Callable[[], object]], repeats: int, warmup: int = 0,
              warm: dict[Hashable, Callable[[], object]] | None = None,
              order: Callable[[int], Iterable[Hashable]] | None = None,
              after_round: Callable[[], object] | None = None, seconds: float = 0.0) -> dict[Hashable, Runs]:
    """Time `contenders` alternately, after a warm-up, so that background load hits them all alike.

    Warm-up (allocator, first-call overheads): each callable of `warm` (default: the contenders themselves; a shorter
    run, say) is called `warmup` times, untimed, in turn. Then `repeats` rounds, or more, until the rounds have taken
    `seconds` (short contenders get more rounds; a ratio of a few short rounds is noise): each calls every contender once,
    timed, in the order ``order(round)`` (default: as given), then ``after_round()`` (a measurement that must see the
    same machine as the round, say). Returns {contender: Runs}; ``Runs.median`` is its median seconds per call.
    Where COURSE_TIMING_ROUNDS is set, at most that many rounds, whatever `repeats` and `seconds` ask.
    """
    check_positive("repeats", repeats)
    if warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    for call in (contenders if warm is None else warm).values():
        for _ in range(warmup):
            call()
    runs = {name: Runs([], []) for name in contenders}
    most = rounds_cap()
    first, k = time.perf_counter(), 0
    while (k < repeats or time.perf_counter() - first < seconds) and k < most:
        for name in (contenders if order is None else order(k)):
            start = time.perf_counter()
            result = contenders[name]()
            runs[name].seconds.append(time.perf_counter() - start)
            runs[name].results.append(result)
        if after_round is not None:
            after_round()
        k += 1
    return runs


def sleep_until(start: float, at: float) -> None:
    """Wait until `at` seconds after the perf_counter reading `start`."""
    delay = start + at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
