"""tests/schedule.py: xdist's workers get the longest work first, SPLIT files one test at a time, and a notebook's
run as on another CPU apart from its run as is; the table names files that exist."""
from __future__ import annotations

import subprocess
from fnmatch import fnmatch
from types import SimpleNamespace

from tests.helpers import ROOT
from tests.schedule import OTHER_CPU, SECONDS, SPLIT, LongestFirst


class Worker:
    """What the scheduler sees of an xdist worker: it is sent test indices (logged in ``handed``), and shut down."""

    shutting_down = False

    def __init__(self, name: str, handed: list):
        self.gateway = SimpleNamespace(id=name)
        self.handed = handed

    def send_runtest_some(self, indices):
        self.handed.append((self, list(indices)))

    def shutdown(self):
        self.shutting_down = True


def handed_out(collection: list[str]) -> list[list[str]]:
    """The units of work (lists of test ids) in the order they are handed out to two workers, when the batches
    finish in the order they were sent."""
    scheduler = LongestFirst(SimpleNamespace(getvalue=lambda name: ["2*popen"], option=SimpleNamespace(loadscopereorder=True)))
    handed: list = []
    workers = [Worker("gw0", handed), Worker("gw1", handed)]
    for worker in workers:
        scheduler.add_node(worker)
    for worker in workers:
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    finished = 0
    while finished < len(handed):
        worker, indices = handed[finished]
        finished += 1
        for index in indices:
            scheduler.mark_test_complete(worker, index)
    assert sorted(i for _, indices in handed for i in indices) == list(range(len(collection)))
    assert all(worker.shutting_down for worker in workers)
    return [[collection[i] for i in indices] for _, indices in handed]


def test_the_longest_unit_goes_first_and_split_files_go_one_test_at_a_time():
    notebook = "solutions/01-attention/attention.ipynb"
    collection = [
        "tests/lib/test_layers.py::test_a", "tests/lib/test_layers.py::test_b", "tests/lib/test_layers.py::test_c",
        "tests/grading/test_release_runs.py::test_runs[01-attention]", "tests/grading/test_release_runs.py::test_runs[02-multihead]",
        f"{notebook}::Cell 0", f"{notebook}::Cell 1", f"{notebook}::{OTHER_CPU}::Cell 0", f"{notebook}::{OTHER_CPU}::Cell 1",
        "tests/system/test_hub.py::test_x", "tests/chapters/ch01/test_grading_01.py::test_y",
        "tests/chapters/ch01/test_grading_01.py::test_z",
    ]
    order = handed_out(collection)
    assert order == [
        ["tests/chapters/ch01/test_grading_01.py::test_y", "tests/chapters/ch01/test_grading_01.py::test_z"],  # 75 s
        ["tests/system/test_hub.py::test_x"],  # 65 s
        [f"{notebook}::Cell 0", f"{notebook}::Cell 1"],  # 25 s each: as is, then as on another CPU
        [f"{notebook}::{OTHER_CPU}::Cell 0", f"{notebook}::{OTHER_CPU}::Cell 1"],
        ["tests/grading/test_release_runs.py::test_runs[01-attention]"],  # 15 s each, apart
        ["tests/grading/test_release_runs.py::test_runs[02-multihead]"],
        ["tests/lib/test_layers.py::test_a", "tests/lib/test_layers.py::test_b", "tests/lib/test_layers.py::test_c"],
    ], order


def test_every_file_the_schedule_names_exists():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    unmatched = [pattern for pattern in SECONDS if not any(fnmatch(path, pattern) for path in tracked)]
    assert not unmatched, f"tests/schedule.py SECONDS names files that are not there: {unmatched}"
    assert SPLIT <= set(tracked), SPLIT - set(tracked)
