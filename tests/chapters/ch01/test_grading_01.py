"""Chapter 01's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades several students of chapter 01 (and the reference of
chapter 00). Each planted bug must lose exactly the points of the tests that target it;
the set each bug should fail is derived from what each test is documented to check
(the comment at the top of every test cell), not from running the tests.
"""
from __future__ import annotations

import csv
import shutil

import pytest

from course_lib import grading
from tests.helpers import ROOT
from tests.roundtrip import Chapter, assert_loses_exactly, digest, write_submissions
from tests.planted import ACCIDENT_NOTES, accidents

CH = Chapter("01-attention", "attention")
SDPA = "scaled_dot_product_attention-solution"
UNSCALED = CH.mutate(SDPA, " / math.sqrt(d_k)", "")
NAIVE_MASKED_SOFTMAX = '''def masked_softmax(scores, mask=None):
    if mask is None:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
'''


def tampered() -> dict:
    """Unscaled attention, plus every trick on the test cells: its visible test edited to `pass` and worth 100
    points, a hidden test cell deleted and replaced by a `pass` copy of itself that carries the original's cell id,
    another test cell switched to markdown, one cell's metadata stripped, the answer cell made a test worth 50."""
    import copy

    from tests.helpers import nbgrader_cells

    notebook = CH.solved({SDPA: UNSCALED})
    cells = nbgrader_cells(notebook)
    visible = cells["scaled_dot_product_attention-visible"]
    visible["source"], visible["metadata"]["nbgrader"]["points"] = "pass", 100
    del cells["scaled_dot_product_attention-mask"]["metadata"]["nbgrader"]
    scale = cells["scaled_dot_product_attention-scale"]
    impostor = copy.deepcopy(scale)
    impostor["source"] = "pass"
    notebook["cells"][notebook["cells"].index(scale)] = impostor
    batch = cells["scaled_dot_product_attention-batch"]
    batch["cell_type"] = "markdown"
    del batch["outputs"], batch["execution_count"]
    cells[SDPA]["metadata"]["nbgrader"].update(grade=True, points=50)
    return notebook


def exercise_deleted() -> dict:
    """A perfect notebook from which the learner deleted every cell of the masked_softmax exercise, answer and tests."""
    notebook = CH.solved()
    notebook["cells"] = [c for c in notebook["cells"]
                         if not c.get("metadata", {}).get("nbgrader", {}).get("grade_id", "").startswith("masked_softmax-")]
    return notebook


#: Files that are notebooks but not the chapter's: each is recorded in one plain line, not nbgrader's traceback.
NOT_THIS_NOTEBOOK = {
    "old_format": ({"nbformat": 3, "nbformat_minor": 0, "metadata": {"name": "attention"},
                    "worksheets": [{"cells": [{"cell_type": "code", "input": "x = 1", "language": "python", "outputs": []}]}]},
                   "an nbformat 3 notebook"),
    "another_notebook": ({"nbformat": 4, "nbformat_minor": 5, "metadata": {},
                          "cells": [{"id": "c1", "cell_type": "markdown", "metadata": {}, "source": "# Homework 3"},
                                    {"id": "c2", "cell_type": "code", "metadata": {}, "source": "x = 1", "outputs": [],
                                     "execution_count": None}]},
                         "none of this chapter's cells"),
}


#: seconds one test may run: the infinite loop keeps a core busy that long. Chapter 01's slowest graded test cell takes
#: 0.2 s in nbval on a loaded machine (0.06 s in the clean room at 1.8 runnable processes per core): 10 times that is
#: left (the grading attacks use the same limit).
TIMEOUT = 2

# student -> (notebook, the tests that must fail)
STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "unscaled": (lambda: CH.solved({SDPA: UNSCALED}),
                 {"scaled_dot_product_attention-visible", "scaled_dot_product_attention-scale"}),
    # a mistake with masks in three exercises, each charged once: additive_attention and scaled_dot_product_attention call
    # masked_softmax, and the build exercise's decoder_step calls additive_attention, but each exercise is tested with the
    # reference versions of the others, so the NaN of the naive masked_softmax and the ignored masks cost only their own
    "masks": (lambda: CH.solved({
        "masked_softmax-solution": NAIVE_MASKED_SOFTMAX,
        "additive_attention-solution": CH.mutate("additive_attention-solution", "masked_softmax(energies, mask)", "masked_softmax(energies)"),
        "attention_decoder-solution": CH.mutate("attention_decoder-solution", "attention.v, src_mask.unsqueeze(1))", "attention.v)")}),
        # the visible checks run a padding mask too (issue 24: an ignored mask must fail where the learner sees it)
        {"masked_softmax-visible", "masked_softmax-fully_masked", "additive_attention-visible", "additive_attention-mask",
         "attention_decoder-visible", "attention_decoder-query", "attention_decoder-padding", "attention_decoder-trained"}),
    "infinite_loop": (lambda: CH.solved({SDPA: "def scaled_dot_product_attention(q, k, v, mask=None):\n    while True:\n        pass\n"}),
                      CH.tests_of("scaled_dot_product_attention")),
    "tampered": (tampered, {"scaled_dot_product_attention-visible", "scaled_dot_product_attention-scale"}),
    "accidents": (accidents, set()),
    "exercise_deleted": (exercise_deleted, CH.tests_of("masked_softmax")),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    submissions = write_submissions(tmp_path_factory.mktemp("submissions"), CH, {s: make() for s, (make, _) in STUDENTS.items()})
    write_submissions(submissions, CH, {student: notebook for student, (notebook, _) in NOT_THIS_NOTEBOOK.items()})
    shutil.copytree(ROOT / "notebooks" / "00-orientation", submissions / "reference" / "00-orientation")
    before = digest(submissions)
    workdir = tmp_path_factory.mktemp("grading")
    results = grading.grade(submissions, workdir, cell_timeout=TIMEOUT)
    return {(r.student, r.chapter): r for r in results}, workdir, before, digest(submissions)


@pytest.mark.slow
@pytest.mark.parametrize("student", list(STUDENTS))
def test_each_submission_loses_exactly_the_points_of_the_tests_its_bug_targets(graded, student):
    results, *_ = graded
    assert_loses_exactly(results[(student, CH.name)], CH, STUDENTS[student][1])


@pytest.mark.slow
def test_reference_gets_full_marks_and_untouched_release_zero(graded):
    results, *_ = graded
    assert results[("reference", CH.name)].score == results[("reference", CH.name)].max_score == sum(CH.points.values()) > 0
    assert results[("untouched", CH.name)].score == 0
    orientation = results[("reference", "00-orientation")]
    assert not orientation.error and orientation.max_score == 0


@pytest.mark.slow
def test_tampering_with_test_cells_and_points_gains_nothing(graded):
    results, workdir, *_ = graded
    tampered_result, unscaled = results[("tampered", CH.name)], results[("unscaled", CH.name)]
    assert [(t.grade_id, t.score, t.max_score) for t in tampered_result.tests] == [(t.grade_id, t.score, t.max_score) for t in unscaled.tests]
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{workdir / 'runs' / CH.name / 'tampered' / 'gradebook.db'}") as gradebook:
        notebook = gradebook.find_submission_notebook(CH.notebook, CH.name, "tampered")
        assert (notebook.score, notebook.max_score) == (unscaled.score, sum(CH.points.values()))


@pytest.mark.slow
def test_the_interrupted_infinite_loop_is_an_error_not_a_silent_zero(graded):
    results, *_ = graded
    tests = {t.grade_id: t for t in results[("infinite_loop", CH.name)].tests}
    for grade_id in CH.tests_of("scaled_dot_product_attention"):
        assert tests[grade_id].status == "error" and f"did not finish within {TIMEOUT} s" in tests[grade_id].error
    assert all(t.status == "passed" for g, t in tests.items() if g not in CH.tests_of("scaled_dot_product_attention"))


@pytest.mark.slow
def test_grading_leaves_submissions_untouched_and_writes_csvs_and_feedback(graded):
    results, workdir, before, after = graded
    assert before == after
    with (workdir / "grades.csv").open() as fh:  # one row per student and chapter notebook
        rows = {(r["student"], r["chapter"]): float(r["score"]) for r in csv.DictReader(fh)}
    assert set(rows) == {(s, CH.name) for s in [*STUDENTS, *NOT_THIS_NOTEBOOK]} | {("reference", "00-orientation")}
    assert rows[("reference", CH.name)] == sum(CH.points.values()) and rows[("untouched", CH.name)] == 0
    by_test = (workdir / "grades_by_test.csv").read_text().splitlines()
    assert len(by_test) == 1 + len(STUDENTS) * len(CH.points) + len(NOT_THIS_NOTEBOOK)  # one error row each
    for student in STUDENTS:
        assert (workdir / "runs" / CH.name / student / "feedback" / student / CH.name / f"{CH.notebook}.html").is_file()


@pytest.mark.slow
def test_report_lists_every_exercise_with_points(graded):
    results, *_ = graded
    report = grading.format_report(results[("unscaled", CH.name)])
    total = sum(CH.points.values())
    assert f"total {' ' * 29}{total - 2:g} / {total:g}" in report
    assert "✗ scaled_dot_product_attention-scale" in report and "✓ masked_softmax-visible" in report
    assert "scaled by 1; the expected scale is 1/sqrt(d_k)" in report


@pytest.mark.slow
def test_accidents_cost_nothing_and_are_reported_in_plain_words(graded):
    results, workdir, *_ = graded
    result = results[("accidents", CH.name)]
    assert result.score == result.max_score and sorted(result.notes) == sorted(ACCIDENT_NOTES)
    assert all(f"note: {note}" in grading.format_report(result) for note in ACCIDENT_NOTES)
    with (workdir / "grades.csv").open() as fh:
        row = next(r for r in csv.DictReader(fh) if r["student"] == "accidents")
    assert row["status"] == "graded" and all(note in row["notes"] for note in ACCIDENT_NOTES)
    feedback = (workdir / "runs" / CH.name / "accidents" / "feedback" / "accidents" / CH.name / f"{CH.notebook}.html").read_text()
    assert "a copy of masked_softmax-solution was ignored" in feedback


@pytest.mark.slow
@pytest.mark.parametrize("student", list(NOT_THIS_NOTEBOOK))
def test_a_notebook_that_is_not_the_chapters_is_recorded_in_one_plain_line(graded, student):
    results, workdir, *_ = graded
    said = NOT_THIS_NOTEBOOK[student][1]
    assert results[(student, CH.name)].error.startswith(f"not graded: {CH.notebook}.ipynb is not this chapter's notebook")
    with (workdir / "grades.csv").open() as fh:
        row = next(r for r in csv.DictReader(fh) if r["student"] == student)
    assert row["status"] == "error" and said in row["errors"]
    assert "\n" not in row["errors"] and "Traceback" not in row["errors"], row["errors"]
