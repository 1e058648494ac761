"""How `pytest -n 2 --dist loadfile` shares the suite between its workers: the longest work first, in an order measured
by the last full run, not kept by hand.

xdist's loadfile hands each worker a whole test file at a time (a module fixture such as a grading round trip runs
once), in order of the number of tests a file holds: the files of few but slow tests (the round trips, the hub) came
last, and the run ended with one worker busy and the other idle. Here a run is cut into units of work:

* a test file is a unit;
* a notebook is two units: as is, and as on another CPU (``--other-cpu``, conftest.py);
* the files listed in ``SPLIT``, whose tests share no expensive fixture, are one unit per test;
* the chapters' grading round trips (the files that define ``ROUND_TRIP_TEST``, tests/roundtrip.py) are one unit
  together: they share one grading run (its clean rooms are one per student, for every chapter at once).

The next unit handed out is the one that took longest in the last recorded run: ``DURATIONS`` (tests/durations.json,
seconds per unit, the sum of its tests' set-up, call and tear-down). ``make test`` records it (``--record-durations``):
the file is rewritten at the end of each full run with what that run measured, and committed like any other file.
A unit it does not name (a new file) counts as quick and keeps xdist's order until the next full run records it.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

#: seconds each unit of work took in the last full run (`make test`), written by ``DurationRecorder``
DURATIONS = Path(__file__).with_name("durations.json")

#: Files whose tests are independent and slow: one work unit per test.
SPLIT = {"tests/grading/test_release_runs.py"}

#: The name under which a notebook is collected a second time, to run as on another CPU (conftest.py).
OTHER_CPU = "other-cpu"

#: The test every chapter's round trip defines (tests/roundtrip.py); its files are one unit, ``ROUND_TRIPS``.
ROUND_TRIP_TEST = "test_reference_untouched_and_submissions"
ROUND_TRIPS = "tests/chapters/*/test_grading_*.py (round trips)"


def read_durations(path: Path = DURATIONS) -> dict[str, float]:
    """unit -> seconds, as recorded; {} when there is no record yet."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def round_trip_files(collection) -> set[str]:
    """The test files of a collection (node ids) that are chapters' round trips."""
    return {nodeid.split("::", 1)[0] for nodeid in collection if nodeid.split("::")[-1] == ROUND_TRIP_TEST}


def unit_of(nodeid: str, round_trips: set[str] = frozenset()) -> str:
    """The unit of work a test belongs to (see the module's docstring)."""
    path, _, rest = nodeid.partition("::")
    if path in SPLIT:
        return nodeid
    if path in round_trips:
        return ROUND_TRIPS
    if rest.startswith(f"{OTHER_CPU}::"):  # the notebook as on another CPU: a unit apart from the notebook as is
        return f"{path}::{OTHER_CPU}"
    return path


class LongestFirst(LoadFileScheduling):
    """loadfile, cut into the units above, the longest (as last recorded) first."""

    def __init__(self, config, log=None, durations: dict[str, float] | None = None):
        super().__init__(config, log)
        self.durations = read_durations() if durations is None else durations
        self.round_trips: set[str] = set()

    def schedule(self) -> None:
        if self.collection is None and self.registered_collections:
            self.round_trips = round_trip_files(next(iter(self.registered_collections.values())))
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid, self.round_trips)

    def _assign_work_unit(self, node) -> None:
        """Hand out the longest unit waiting (the first of equals in xdist's order)."""
        longest = max(self.workqueue, key=lambda unit: self.durations.get(unit, 0.0))
        self.workqueue.move_to_end(longest, last=False)
        super()._assign_work_unit(node)


class DurationRecorder:
    """Sums each unit's tests' durations as their reports arrive (in xdist's controller, or in a run without
    xdist), and at the end of a session that ran to its end writes them into ``DURATIONS``: the units this run
    measured get its figures (whole seconds), the others keep theirs unless their file is gone; under a second
    is not recorded (it counts as quick anyway)."""

    def __init__(self, root: Path, path: Path = DURATIONS):
        self.root, self.path = root, path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if not self.seconds or exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            return
        round_trips = round_trip_files(self.seconds)
        measured: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.seconds.items():
            measured[unit_of(nodeid, round_trips)] += seconds
        kept = {unit: s for unit, s in read_durations(self.path).items()
                if unit == ROUND_TRIPS or (self.root / unit.split("::", 1)[0]).exists()}
        kept.update({unit: round(s) for unit, s in measured.items()})
        self.path.write_text(json.dumps({unit: s for unit, s in sorted(kept.items()) if s >= 1}, indent=1) + "\n")


class SkipSlowerThan:
    """``--skip-slower-than SECONDS`` (`make quick`): the tests of the units that took longer in the recorded run are
    deselected, and the summary lists those units with their seconds."""

    def __init__(self, seconds: float, path: Path = DURATIONS):
        self.limit, self.path = seconds, path

    def slower_units(self, config) -> dict[str, float]:
        """The recorded units slower than the limit, under the paths this run was given."""
        given = [Path(arg.split("::", 1)[0]).resolve() for arg in config.args] or [config.rootpath]

        def under_given(unit: str) -> bool:
            path = (config.rootpath / unit.split("::", 1)[0]).resolve()
            return any(folder == path or folder in path.parents for folder in given)

        return {unit: s for unit, s in read_durations(self.path).items() if s > self.limit and under_given(unit)}

    def pytest_collection_modifyitems(self, config, items) -> None:
        slow, round_trips = self.slower_units(config), round_trip_files(item.nodeid for item in items)
        left_out = [item for item in items if unit_of(item.nodeid, round_trips) in slow]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if unit_of(item.nodeid, round_trips) not in slow]

    def pytest_terminal_summary(self, terminalreporter, config) -> None:
        if hasattr(config, "workerinput"):
            return
        slow = self.slower_units(config)
        terminalreporter.write_line(f"--skip-slower-than {self.limit:g}: left out {len(slow)} units of work that took "
                                    f"{sum(slow.values()) / 60:.0f} min in the recorded run (`make test` runs them):")
        for unit, seconds in sorted(slow.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"  {seconds:5.0f} s  {unit}")


class LongestFirstPlugin:
    """Registered by conftest.py when xdist is loaded."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        return LongestFirst(config, log) if config.getvalue("dist") == "loadfile" else None
