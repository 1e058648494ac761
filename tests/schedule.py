"""How `pytest -n 2 --dist loadfile` shares the suite between its workers: the longest work first.

xdist's loadfile hands each worker a whole test file at a time (a module fixture such as a grading round trip runs
once), in order of the number of tests a file holds: the files of few but slow tests (the round trips, the hub) came
last, and the run ended with one worker busy and the other idle. Here the next file handed out is the one expected
to take longest (``SECONDS``; a file not listed counts as quick and keeps xdist's order), and the files listed in
``SPLIT``, whose tests share no expensive fixture, are handed out one test at a time, so that they spread over both
workers. With ``--other-cpu`` (conftest.py) a notebook is two units: as is, and as on another CPU.
"""
from __future__ import annotations

from fnmatch import fnmatch

import pytest
from xdist.scheduler import LoadFileScheduling

#: Seconds a file's tests take on one of 2 quiet cores (`make test`'s --durations, rounded: only the order matters).
#: Patterns match the file's path; the first that matches counts.
SECONDS = {
    "tests/grading/test_grading_attacks.py": 80,
    "tests/chapters/ch01/test_grading_01.py": 75,
    "tests/system/test_hub.py": 65,
    "tests/lib/test_assets.py": 60,
    "tests/grading/test_release.py": 35,
    "solutions/07-speculative/*.ipynb": 45,
    "solutions/08-memory-bound/*.ipynb": 45,
    "solutions/*.ipynb": 25,
    "tests/chapters/ch*/test_grading_*.py": 25,
    "tests/system/test_collection.py": 25,
    "tests/lib/test_bench.py": 25,
    "tests/lib/test_kv_cache.py": 20,
    "tests/system/test_browser.py": 20,
    "tests/grading/test_release_runs.py": 15,  # each test: it is in SPLIT
}

#: Files whose tests are independent and slow: one work unit per test.
SPLIT = {"tests/grading/test_release_runs.py"}

#: The name under which a notebook is collected a second time, to run as on another CPU (conftest.py).
OTHER_CPU = "other-cpu"


def seconds(scope: str) -> float:
    path = scope.split("::", 1)[0]
    return next((s for pattern, s in SECONDS.items() if fnmatch(path, pattern)), 0.0)


class LongestFirst(LoadFileScheduling):
    """loadfile, but the longest unit of work goes first, and SPLIT files go one test at a time."""

    def _split_scope(self, nodeid: str) -> str:
        path, _, rest = nodeid.partition("::")
        if path in SPLIT:
            return nodeid
        if rest.startswith(f"{OTHER_CPU}::"):  # the notebook as on another CPU: a unit apart from the notebook as is
            return f"{path}::{OTHER_CPU}"
        return path

    def _assign_work_unit(self, node) -> None:
        """Hand out the longest unit waiting (the first of equals in xdist's order)."""
        longest = max(self.workqueue, key=seconds)
        self.workqueue.move_to_end(longest, last=False)
        super()._assign_work_unit(node)


class LongestFirstPlugin:
    """Registered by conftest.py when xdist is loaded."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        return LongestFirst(config, log) if config.getvalue("dist") == "loadfile" else None
