"""Helpers for a chapter's grading round trip: build student notebooks, grade them, compare.

A chapter's test file (tests/chapters/chNN/test_grading_NN.py) describes its students: a notebook each
(the release filled in with the reference solutions, some with a planted bug) and the set
of tests that must fail, derived from what each test cell is documented to check.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

from course_lib import grading
from tests.helpers import ROOT, load_notebook, nbgrader_cells, strip_solution_markers
from tests.schedule import ROUND_TRIP_TEST


@dataclass(frozen=True)
class Chapter:
    name: str  # "01-attention"
    notebook: str  # "attention"

    @property
    def release(self) -> Path:
        return ROOT / "notebooks" / self.name / f"{self.notebook}.ipynb"

    @property
    def source(self) -> Path:
        return ROOT / "solutions" / self.name / f"{self.notebook}.ipynb"

    @cached_property
    def points(self) -> dict[str, float]:
        """grade_id -> points of every graded test cell, read from the source notebook."""
        return {gid: c["metadata"]["nbgrader"]["points"] for gid, c in nbgrader_cells(load_notebook(self.source)).items()
                if c["metadata"]["nbgrader"]["grade"]}

    def tests_of(self, exercise: str) -> set[str]:
        return {gid for gid in self.points if gid.split("-", 1)[0] == exercise}

    def reference_code(self, grade_id: str) -> str:
        return strip_solution_markers("".join(nbgrader_cells(load_notebook(self.source))[grade_id]["source"]))

    def mutate(self, grade_id: str, old: str, new: str) -> str:
        """The reference solution of grade_id with one planted bug (old -> new)."""
        code = self.reference_code(grade_id)
        assert old in code, f"the planted bug no longer applies to {grade_id}: {old!r} not found"
        return code.replace(old, new)

    def solved(self, overrides: dict[str, str] | None = None) -> dict:
        """The release notebook with its solution cells filled in as a student would (reference code unless overridden)."""
        notebook = load_notebook(self.release)
        for grade_id, cell in nbgrader_cells(notebook).items():
            if cell["metadata"]["nbgrader"]["solution"]:
                cell["source"] = (overrides or {}).get(grade_id) or self.reference_code(grade_id)
        return notebook

    def untouched(self) -> dict:
        return load_notebook(self.release)


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def write_submissions(folder: Path, chapter: Chapter, notebooks: dict[str, dict]) -> Path:
    """folder/<student>/<chapter>/<notebook>.ipynb for each student."""
    for student, notebook in notebooks.items():
        target = folder / student / chapter.name
        target.mkdir(parents=True, exist_ok=True)
        (target / f"{chapter.notebook}.ipynb").write_text(json.dumps(notebook, indent=1))
    return folder


def assert_loses_exactly(result: grading.NotebookResult, chapter: Chapter, must_fail: set[str]) -> None:
    """Every test cell was graded; exactly must_fail failed; the score is the total minus their points."""
    assert not result.error, result.error
    assert {t.grade_id for t in result.tests} == set(chapter.points), "every test cell is graded, even deleted or edited ones"
    failed = {t.grade_id for t in result.tests if not t.passed}
    assert failed == must_fail, f"{result.student}: failed {sorted(failed)}, expected {sorted(must_fail)}"
    assert result.score == sum(chapter.points.values()) - sum(chapter.points[g] for g in must_fail)
    for test in result.tests:
        assert bool(test.message) == (not test.passed), f"{test.grade_id}: a failure must say why, a pass must not"


def assert_reference_full_untouched_zero(graded, chapter: Chapter, total: float) -> None:
    """On a chapter's ``grade_round_trips`` result: the reference scores ``total`` (the chapter's points), the untouched
    release scores 0, and grading left every submission byte for byte as it was; without feedback, nbgrader's
    gradebook is written and no feedback HTML."""
    results, before, after, workdir = graded
    reference = results[("reference", chapter.name)]
    assert reference.score == reference.max_score == sum(chapter.points.values()) == total
    assert results[("untouched", chapter.name)].score == 0
    assert before == after, "grading modified a submission"
    run = workdir / "runs" / chapter.name / "reference"
    assert (run / "gradebook.db").is_file() and not (run / "feedback").exists()


def messages(graded, chapter: Chapter, student: str) -> dict[str, str]:
    """grade_id -> the failure message of each test of one student."""
    return {t.grade_id: t.message for t in graded[0][(student, chapter.name)].tests}


#: every ``round_trip`` of this session (one per chapter test file, registered when the file is imported):
#: its ``graded`` fixture -> (chapter, students, cell_timeout)
ROUND_TRIPS: dict = {}


def grade_round_trips(tmp_path_factory, session) -> dict[str, tuple]:
    """Grade the students of every round trip that has a test in this session, in one grading run per cell time
    limit; chapter name -> (results by (student, chapter), digests of the submissions before and after, workdir).

    A student's name stands for one clean room across chapters, as a learner's whole course is graded: chapter 05's
    ``planted_a`` and chapter 09's are one student with a bug in each chapter, each chapter's tests run with the
    reference versions of that chapter's other exercises. The clean room's start (Python, torch, the set-up cells'
    imports) is most of a small chapter's grading: paid once per student, not once per student and chapter."""
    fixtures = {id(fixture): fixture for fixture in ROUND_TRIPS}
    modules = {item.module for item in session.items if getattr(item, "module", None) is not None}
    wanted = sorted((ROUND_TRIPS[fixtures[id(value)]] for module in modules for value in vars(module).values() if id(value) in fixtures),
                    key=lambda trip: trip[0].name)
    graded = {}
    for cell_timeout in sorted({timeout for _, _, timeout in wanted}):
        chapters = [(chapter, students) for chapter, students, timeout in wanted if timeout == cell_timeout]
        submissions = tmp_path_factory.mktemp("submissions")
        for chapter, students in chapters:
            write_submissions(submissions, chapter, {s: make() for s, (make, _) in students.items()})
        before = digest(submissions)
        workdir = tmp_path_factory.mktemp("grading")
        results = grading.grade(submissions, workdir, cell_timeout=cell_timeout, feedback=False)
        by_key = {(r.student, r.chapter): r for r in results}
        graded.update({chapter.name: (by_key, before, digest(submissions), workdir) for chapter, _ in chapters})
    return graded


def round_trip(chapter: Chapter, students: dict, total: float, cell_timeout: int = 60):
    """The standard round trip of a chapter, for a test module to bind at top level:

        graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = \\
            round_trip(CH, STUDENTS, total=13)

    ``graded`` grades ``{student: (make_notebook, must_fail)}`` with nbgrader (a module fixture: the session's
    ``round_trips``, one grading run for every chapter's round trip, ``grade_round_trips``);
    the first test checks each student loses exactly the points of ``must_fail``, the second that the
    reference scores ``total``, the untouched release 0, and that no submission was modified.
    xdist hands the round trips' files to one worker as one unit of work (tests/schedule.py).
    """
    @pytest.fixture(scope="module")
    def graded(round_trips):
        return round_trips[chapter.name]

    ROUND_TRIPS[graded] = (chapter, students, cell_timeout)

    @pytest.mark.slow
    @pytest.mark.parametrize("student", list(students))
    def test_each_student_loses_exactly_its_bugs_points(graded, student):
        assert_loses_exactly(graded[0][(student, chapter.name)], chapter, students[student][1])

    @pytest.mark.slow
    def test_reference_untouched_and_submissions(graded):
        assert_reference_full_untouched_zero(graded, chapter, total)

    assert test_reference_untouched_and_submissions.__name__ == ROUND_TRIP_TEST  # the scheduler's sign of a round trip
    return graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions
