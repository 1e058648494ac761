"""tests/schedule.py: xdist's workers get the longest work first (as recorded in tests/durations.json), SPLIT files
one test at a time, a notebook's run as on another CPU apart from its run as is, the chapters' round trips as one
unit; a run records what each unit took; the record names files that exist."""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

from tests.helpers import ROOT
from tests.schedule import (DURATIONS, OTHER_CPU, ROUND_TRIP_TEST, ROUND_TRIPS, SPLIT, DurationRecorder, LongestFirst, SkipSlowerThan,
                            read_durations)


pytest_plugins = ["pytester"]


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


def handed_out(collection: list[str], durations: dict[str, float]) -> list[list[str]]:
    """The units of work (lists of test ids) in the order they are handed out to two workers, when the batches
    finish in the order they were sent."""
    scheduler = LongestFirst(SimpleNamespace(getvalue=lambda name: ["2*popen"], option=SimpleNamespace(loadscopereorder=True)),
                             durations=durations)
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
    ch02, ch03 = "tests/chapters/ch02/test_grading_02.py", "tests/chapters/ch03/test_grading_03.py"
    collection = [
        "tests/lib/test_layers.py::test_a", "tests/lib/test_layers.py::test_b", "tests/lib/test_layers.py::test_c",
        "tests/grading/test_release_runs.py::test_runs[01-attention]", "tests/grading/test_release_runs.py::test_runs[02-multihead]",
        f"{notebook}::Cell 0", f"{notebook}::Cell 1", f"{notebook}::{OTHER_CPU}::Cell 0", f"{notebook}::{OTHER_CPU}::Cell 1",
        f"{ch02}::test_each[reference]", f"{ch02}::{ROUND_TRIP_TEST}", "tests/chapters/ch02/test_checks_02.py::test_c",
        "tests/system/test_hub.py::test_x", "tests/chapters/ch01/test_grading_01.py::test_y",
        "tests/chapters/ch01/test_grading_01.py::test_z", f"{ch03}::{ROUND_TRIP_TEST}", f"{ch03}::test_messages",
    ]
    durations = {"tests/chapters/ch01/test_grading_01.py": 75, "tests/system/test_hub.py": 65, ROUND_TRIPS: 70,
                 notebook: 25, f"{notebook}::{OTHER_CPU}": 30, "tests/grading/test_release_runs.py::test_runs[01-attention]": 15,
                 "tests/grading/test_release_runs.py::test_runs[02-multihead]": 16, "tests/lib/test_layers.py": 0.5}
    order = handed_out(collection, durations)
    assert order == [
        ["tests/chapters/ch01/test_grading_01.py::test_y", "tests/chapters/ch01/test_grading_01.py::test_z"],  # 75 s
        [f"{ch02}::test_each[reference]", f"{ch02}::{ROUND_TRIP_TEST}", f"{ch03}::{ROUND_TRIP_TEST}", f"{ch03}::test_messages"],
        ["tests/system/test_hub.py::test_x"],  # 65 s
        [f"{notebook}::{OTHER_CPU}::Cell 0", f"{notebook}::{OTHER_CPU}::Cell 1"],  # as on another CPU (30 s), then as is
        [f"{notebook}::Cell 0", f"{notebook}::Cell 1"],
        ["tests/grading/test_release_runs.py::test_runs[02-multihead]"],  # 16 s and 15 s, apart
        ["tests/grading/test_release_runs.py::test_runs[01-attention]"],
        ["tests/lib/test_layers.py::test_a", "tests/lib/test_layers.py::test_b", "tests/lib/test_layers.py::test_c"],
        ["tests/chapters/ch02/test_checks_02.py::test_c"],  # not recorded: xdist's order (fewer tests after more)
    ], order


def test_a_run_records_what_each_unit_took_for_the_next_run_to_read(pytester):
    """--record-durations writes each unit's seconds (set-up, call and tear-down of its tests) into the record,
    keeping the units it did not run whose files exist; the scheduler reads that record."""
    # 0.8 s + 0.7 s: their sum is recorded as 2 s (either alone as 1 s), with up to a second of overhead on a busy machine
    pytester.makepyfile(test_slow="import time\ndef test_a():\n    time.sleep(0.8)\ndef test_b():\n    time.sleep(0.7)\n",
                        test_quick="def test_c():\n    pass\n")
    record = pytester.path / "durations.json"
    record.write_text('{"test_gone.py": 9, "test_other.py": 4}')
    (pytester.path / "test_other.py").write_text("")
    result = pytester.runpytest_inprocess("-p", "no:xdist", "test_slow.py", "test_quick.py",
                                          plugins=[DurationRecorder(pytester.path, record)])
    result.assert_outcomes(passed=3)
    assert read_durations(record) == {"test_other.py": 4, "test_slow.py": 2}


def test_skip_slower_than_leaves_out_the_units_the_record_found_slower_and_says_so(pytester):
    pytester.makepyfile(test_slow="def test_a():\n    pass\ndef test_b():\n    pass\n",
                        test_quick="def test_c():\n    pass\n", test_new="def test_d():\n    pass\n")
    record = pytester.path / "durations.json"
    record.write_text('{"test_slow.py": 40, "test_quick.py": 3, "test_elsewhere.py": 99}')
    result = pytester.runpytest_inprocess("-p", "no:xdist", "test_slow.py", "test_quick.py", "test_new.py",
                                          plugins=[SkipSlowerThan(10, record)])
    result.assert_outcomes(passed=2, deselected=2)  # test_new.py is not recorded: it runs
    result.stdout.fnmatch_lines(["*left out 1 units of work*", "*40 s  test_slow.py"])
    assert "test_elsewhere" not in result.stdout.str()  # not among the paths this run was given


def test_the_record_names_units_that_exist():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    durations = read_durations()
    assert durations, f"{DURATIONS} is missing: `make test` writes it"
    missing = [unit for unit in durations if unit != ROUND_TRIPS and unit.split("::", 1)[0] not in tracked]
    assert not missing, f"{DURATIONS} names files that are not there (the next `make test` drops them): {missing}"
    assert SPLIT <= set(tracked), SPLIT - set(tracked)
