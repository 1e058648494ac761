"""The grading round trip, through nbgrader, with real submission notebooks.

One `grading.grade` run grades several students of chapter 01 (and the reference of
chapter 00). Each planted bug must lose exactly the points of the tests that target it;
the set each bug should fail is derived from what each test is documented to check
(see the comment at the top of every test cell), not from running the tests.
"""
from __future__ import annotations

import csv
import hashlib
import json
import shutil

import pytest

from course_lib import grading
from tests.conftest import ROOT, load_notebook, nbgrader_cells, strip_solution_markers

CHAPTER = "01-attention"
NOTEBOOK = "attention"
RELEASE = ROOT / "notebooks" / CHAPTER / f"{NOTEBOOK}.ipynb"
SOURCE = ROOT / "solutions" / CHAPTER / f"{NOTEBOOK}.ipynb"
POINTS = {gid: c["metadata"]["nbgrader"]["points"] for gid, c in nbgrader_cells(load_notebook(SOURCE)).items()
          if c["metadata"]["nbgrader"]["grade"]}
SDPA_TESTS = {gid for gid in POINTS if gid.startswith("scaled_dot_product_attention-")}


def reference_code(grade_id: str) -> str:
    return strip_solution_markers("".join(nbgrader_cells(load_notebook(SOURCE))[grade_id]["source"]))


def mutate(grade_id: str, old: str, new: str) -> str:
    code = reference_code(grade_id)
    assert old in code, f"the planted bug no longer applies to {grade_id}: {old!r} not found"
    return code.replace(old, new)


NAIVE_MASKED_SOFTMAX = '''def masked_softmax(scores, mask=None):
    if mask is None:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
'''


def solved(overrides: dict[str, str] | None = None) -> dict:
    """The release notebook with its solution cells filled in as a student would (reference code unless overridden)."""
    notebook = load_notebook(RELEASE)
    for grade_id, cell in nbgrader_cells(notebook).items():
        if cell["metadata"]["nbgrader"]["solution"]:
            cell["source"] = (overrides or {}).get(grade_id) or reference_code(grade_id)
    return notebook


def tampered() -> dict:
    """Unscaled attention, plus: its visible test edited to `pass`, its hidden test cell deleted, metadata stripped."""
    notebook = solved({"scaled_dot_product_attention-solution": mutate("scaled_dot_product_attention-solution", " / math.sqrt(d_k)", "")})
    cells = nbgrader_cells(notebook)
    cells["scaled_dot_product_attention-visible"]["source"] = "pass"
    del cells["scaled_dot_product_attention-mask"]["metadata"]["nbgrader"]
    notebook["cells"].remove(cells["scaled_dot_product_attention-scale"])
    return notebook


# student -> (notebook, the tests that must fail)
STUDENTS = {
    "reference": (lambda: solved(), set()),
    "untouched": (lambda: load_notebook(RELEASE), set(POINTS)),
    "unscaled": (lambda: solved({"scaled_dot_product_attention-solution": mutate(
        "scaled_dot_product_attention-solution", " / math.sqrt(d_k)", "")}),
        {"scaled_dot_product_attention-visible", "scaled_dot_product_attention-scale"}),
    "nan_on_fully_masked": (lambda: solved({"masked_softmax-solution": NAIVE_MASKED_SOFTMAX}),
                            {"masked_softmax-fully_masked", "scaled_dot_product_attention-fully_masked"}),
    "mask_ignored": (lambda: solved({"additive_attention-solution": mutate(
        "additive_attention-solution", "masked_softmax(energies, mask)", "masked_softmax(energies)")}),
        {"additive_attention-mask"}),
    "infinite_loop": (lambda: solved({"scaled_dot_product_attention-solution": "while True:\n    pass"}), SDPA_TESTS),
    "tampered": (tampered, {"scaled_dot_product_attention-visible", "scaled_dot_product_attention-scale"}),
}


def digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    submissions = tmp_path_factory.mktemp("submissions")
    for student, (make, _) in STUDENTS.items():
        folder = submissions / student / CHAPTER
        folder.mkdir(parents=True)
        (folder / f"{NOTEBOOK}.ipynb").write_text(json.dumps(make(), indent=1))
    shutil.copytree(ROOT / "notebooks" / "00-orientation", submissions / "reference" / "00-orientation")
    before = digest(submissions)
    workdir = tmp_path_factory.mktemp("grading")
    # a short cell timeout keeps the infinite loop cheap; no graded cell needs more than a second
    results = grading.grade(submissions, workdir, cell_timeout=20)
    return {(r.student, r.chapter): r for r in results}, workdir, before, digest(submissions)


@pytest.mark.slow
@pytest.mark.parametrize("student", list(STUDENTS))
def test_each_submission_loses_exactly_the_points_of_the_tests_its_bug_targets(graded, student):
    results, *_ = graded
    result = results[(student, CHAPTER)]
    assert not result.error
    assert {t.grade_id for t in result.tests} == set(POINTS), "every test cell is graded, even deleted or edited ones"
    failed = {t.grade_id for t in result.tests if not t.passed}
    assert failed == STUDENTS[student][1]
    assert result.score == sum(POINTS.values()) - sum(POINTS[g] for g in STUDENTS[student][1])
    for test in result.tests:
        assert bool(test.message) == (not test.passed), f"{test.grade_id}: a failure must say why, a pass must not"


@pytest.mark.slow
def test_reference_gets_full_marks_and_untouched_release_zero(graded):
    results, *_ = graded
    assert results[("reference", CHAPTER)].score == results[("reference", CHAPTER)].max_score == sum(POINTS.values()) > 0
    assert results[("untouched", CHAPTER)].score == 0
    orientation = results[("reference", "00-orientation")]
    assert not orientation.error and orientation.max_score == 0


@pytest.mark.slow
def test_the_infinite_loop_is_reported_as_a_timeout(graded):
    results, *_ = graded
    messages = {t.grade_id: t.message for t in results[("infinite_loop", CHAPTER)].tests}
    assert all("NameError" in messages[g] for g in SDPA_TESTS), messages


@pytest.mark.slow
def test_grading_leaves_submissions_untouched_and_writes_csvs_and_feedback(graded):
    results, workdir, before, after = graded
    assert before == after
    with (workdir / "grades.csv").open() as fh:  # nbgrader's export: one row per student and chapter
        rows = {(r["student_id"], r["assignment"]): float(r["score"]) for r in csv.DictReader(fh)}
    assert set(rows) == {(s, c) for s in STUDENTS for c in ("00-orientation", CHAPTER)}
    assert rows[("reference", CHAPTER)] == sum(POINTS.values()) and rows[("untouched", CHAPTER)] == 0
    by_test = (workdir / "grades_by_test.csv").read_text().splitlines()
    assert len(by_test) == 1 + len(STUDENTS) * len(POINTS)
    for student in STUDENTS:
        assert (workdir / "feedback" / student / CHAPTER / f"{NOTEBOOK}.html").is_file()


@pytest.mark.slow
def test_report_lists_every_exercise_with_points(graded):
    results, *_ = graded
    report = grading.format_report(results[("unscaled", CHAPTER)])
    total = sum(POINTS.values())
    assert f"total {' ' * 29}{total - 2:g} / {total:g}" in report
    assert "✗ scaled_dot_product_attention-scale" in report and "✓ masked_softmax-visible" in report
    assert "scaled by 1; the expected scale is 1/sqrt(d_k)" in report
