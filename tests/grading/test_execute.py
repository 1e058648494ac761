"""`course execute` on a busy machine: it says the load per core and refuses the timed chapters (the Makefile's TIMED
list) unless --busy-ok, so that stored timings do not come from a contended run by accident."""
from __future__ import annotations

import pytest

from course_lib import cli, grading


def test_the_timed_chapters_are_read_from_the_makefile(tmp_path):
    (tmp_path / "Makefile").write_text("JOBS ?= 2\nTIMED = solutions/05-kv-cache \\\n\tsolutions/12-serving\nbusy:\n\techo $(TIMED)\n")
    assert grading.timed_chapters(tmp_path) == ["05-kv-cache", "12-serving"]
    (tmp_path / "Makefile").write_text("test:\n\tpytest\n")
    with pytest.raises(RuntimeError, match="no TIMED = ... line"):
        grading.timed_chapters(tmp_path)


def test_the_course_makefile_lists_existing_chapters_with_timings():
    timed = grading.timed_chapters()
    assert set(timed) <= set(grading.chapters())
    assert {"08-memory-bound", "07-speculative"} <= set(timed)  # the chapters that store timings and read them
    assert not {"01-attention", "09-tokenization"} & set(timed)  # no timing is stored there


def test_busy_refuses_only_the_timed_chapters_and_busy_ok_overrides():
    names = ["07-speculative", "08-memory-bound", "09-tokenization"]
    assert grading.refused_when_busy(names, load=1.0) == ["07-speculative", "08-memory-bound"]
    assert grading.refused_when_busy(names, load=grading.BUSY_LOAD_PER_CORE) == ["07-speculative", "08-memory-bound"]
    assert grading.refused_when_busy(names, load=1.0, busy_ok=True) == []
    assert grading.refused_when_busy(names, load=0.1) == []


def test_load_per_core_is_the_load_average_over_the_usable_cores(monkeypatch):
    monkeypatch.setattr(grading.course.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    monkeypatch.setattr(grading.course.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert grading.load_per_core() == (0.75, 4)


@pytest.fixture
def executed(monkeypatch):
    """What `course execute` would re-execute (nothing is run): the chapter lists handed to execute_solutions."""
    calls = []
    monkeypatch.setattr(grading, "execute_solutions", lambda names: calls.append(names) or [])
    return calls


def _load(monkeypatch, load):
    monkeypatch.setattr(grading, "load_per_core", lambda: (load, 2))


def test_course_execute_refuses_timed_chapters_on_a_busy_machine(monkeypatch, executed, capsys):
    _load(monkeypatch, 0.99)
    assert cli.main(["execute", "08", "09"]) == 1
    assert executed == [["09-tokenization"]]
    out, err = capsys.readouterr()
    assert "machine load: 0.99 per core over the last minute (2 cores): busy" in out
    assert "not re-executing the timed chapters 08-memory-bound on a busy machine" in err and "--busy-ok" in err


def test_course_execute_of_timed_chapters_only_executes_nothing_when_busy(monkeypatch, executed):
    _load(monkeypatch, 0.99)
    assert cli.main(["execute", "07", "08"]) == 1
    assert executed == [[]]  # an empty list, not None: execute_solutions would run every chapter


def test_course_execute_runs_everything_when_quiet_or_told_busy_ok(monkeypatch, executed, capsys):
    _load(monkeypatch, 0.1)
    assert cli.main(["execute", "08", "09"]) == 0
    assert "quiet" in capsys.readouterr().out
    _load(monkeypatch, 0.99)
    assert cli.main(["execute", "--busy-ok", "08", "09"]) == 0
    assert executed == [["08-memory-bound", "09-tokenization"]] * 2
    assert "come from a busy machine" in capsys.readouterr().err


def test_execute_solutions_of_no_chapter_executes_none(tmp_path):
    (tmp_path / "solutions" / "01-x").mkdir(parents=True)
    (tmp_path / "solutions" / "01-x" / "x.ipynb").write_text("not a notebook: reading it would raise")
    assert grading.execute_solutions([], root=tmp_path) == []
