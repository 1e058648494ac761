"""Grading that cannot be gamed: real attack notebooks, graded the way an instructor does.

Oracles: a student with the same (broken) function but no tricks is graded in the same run;
"monkeypatching gains nothing" means the tricksters get exactly that student's results.
Kernel-killing, SIGINT-ignoring and flooding cells must cost only their own exercise, be
marked as errors (never a silent 0), and leave every other student's grading alone.
"""
from __future__ import annotations

import csv
import signal
import subprocess
import sys
import time

import pytest

from course_lib import grading, sandbox
from tests.roundtrip import Chapter, digest, write_submissions

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sandbox.available(), reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap")]

CH = Chapter("01-attention", "attention")
MS = "masked_softmax-solution"
ZEROS = "def masked_softmax(scores, mask=None):\n    return scores * 0\n"
PATCH_NAMES = "('assert_close', 'assert_finite', 'assert_shape', 'assert_rows_sum_to_one', 'assert_masked_are_zero')"
# no 'course_lib' in the text: the static rule must not be what catches these
PATCH_AT_TOP_LEVEL = ZEROS + f'''
import sys
import torch
torch.allclose = lambda *a, **k: True
for _module in list(sys.modules.values()):
    if getattr(_module, "__name__", "").endswith("checks.core") or getattr(_module, "__name__", "").endswith("checks"):
        for _name in {PATCH_NAMES}:
            setattr(_module, _name, lambda *a, **k: None)
'''
PATCH_WHEN_CALLED = f'''def masked_softmax(scores, mask=None):
    import sys
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").endswith(("checks.core", "checks")):
            for name in {PATCH_NAMES}:
                setattr(module, name, lambda *a, **k: None)
    return scores * 0
'''
VANDAL = '''
import glob, os
open("vandal-was-here.txt", "w").write("the one folder it may write")
for _path in glob.glob("../../../../../**/*", recursive=True):  # up to the grading folder
    if os.path.isfile(_path):
        try:
            with open(_path, "a") as _fh:
                _fh.write("#vandalised")
        except OSError:
            pass
'''


def reference(grade_id: str) -> str:
    return CH.reference_code(grade_id)


STUDENTS = {  # the reference solution's full marks are checked in test_grading_01.py
    "zeros": lambda: CH.solved({MS: ZEROS}),
    "patch_at_top_level": lambda: CH.solved({MS: PATCH_AT_TOP_LEVEL}),
    "patch_when_called": lambda: CH.solved({MS: PATCH_WHEN_CALLED}),
    "imports_reference": lambda: CH.solved({MS: "from course_lib.attention import masked_softmax"}),
    "kernel_exit": lambda: CH.solved({MS: reference(MS) + "\nimport os\nos._exit(1)"}),
    "sigint_ignored": lambda: CH.solved({MS: reference(MS) + "\nimport signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass"}),
    "output_flood": lambda: CH.solved({MS: reference(MS) + "\nwhile True:\n    print('flood' * 100)"}),
    "vandal": lambda: CH.solved({MS: reference(MS) + VANDAL}),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    submissions = write_submissions(tmp_path_factory.mktemp("submissions"), CH, {s: make() for s, make in STUDENTS.items()})
    before = digest(submissions)
    workdir = tmp_path_factory.mktemp("grading")
    started = time.perf_counter()
    results = grading.grade(submissions, workdir, cell_timeout=40, jobs=2, sandboxed=True)
    print(f"graded {len(STUDENTS)} students with 2 jobs in {time.perf_counter() - started:.0f} s")
    return {r.student: r for r in results}, workdir, submissions, before


def verdicts(result):
    return {t.grade_id: (t.score, t.passed) for t in result.tests}


@pytest.mark.parametrize("student", ["patch_at_top_level", "patch_when_called"])
def test_monkeypatching_gains_nothing(graded, student):
    """Per test, never more than the same function without tricks (a patch caught in the act may cost more)."""
    results, *_ = graded
    tricked, plain = verdicts(results[student]), verdicts(results["zeros"])
    assert tricked.keys() == plain.keys()
    assert all(tricked[g][0] <= plain[g][0] for g in plain), {g: (tricked[g], plain[g]) for g in plain if tricked[g][0] > plain[g][0]}
    assert results["zeros"].score < sum(CH.points.values())


def test_importing_the_reference_scores_zero_for_that_exercise_only(graded):
    results, *_ = graded
    tests = results["imports_reference"].exercises()
    assert all(t.score == 0 and t.status == "error" and "reference code" in t.error for t in tests["masked_softmax"])
    assert all(t.passed for name, group in tests.items() if name != "masked_softmax" for t in group)


@pytest.mark.parametrize("student,reason", [("kernel_exit", "kernel died"), ("sigint_ignored", "did not finish"),
                                            ("output_flood", "more output than grading allows")])
def test_a_cell_that_stops_the_kernel_costs_its_exercise_as_an_error(graded, student, reason):
    results, workdir, *_ = graded
    exercises = results[student].exercises()
    assert all(t.score == 0 and t.status == "error" and reason in t.error for t in exercises["masked_softmax"])
    assert all(t.passed for name, group in exercises.items() if name != "masked_softmax" for t in group)
    with (workdir / "grades.csv").open() as fh:
        row = next(r for r in csv.DictReader(fh) if r["student"] == student)
    assert row["status"] == "error" and reason in row["errors"]


def test_a_vandal_changes_nothing_outside_its_own_folder(graded):
    results, workdir, submissions, before = graded
    assert results["vandal"].score == results["vandal"].max_score
    own = workdir / "runs" / CH.name / "vandal" / "autograded" / "vandal" / CH.name
    assert (own / "vandal-was-here.txt").is_file(), "the vandal's code did not run"
    # its own folder (and nbgrader's copy of it in its own feedback) is all it could reach
    mine = (own, workdir / "runs" / CH.name / "vandal" / "feedback" / "vandal" / CH.name)
    touched = [p for p in workdir.rglob("*") if p.is_file() and p.read_bytes().endswith(b"#vandalised")]
    assert [str(p) for p in touched if not any(folder in p.parents for folder in mine)] == []
    assert digest(submissions) == before


def test_feedback_and_nbgrader_gradebook_agree_with_the_report(graded):
    from nbgrader.api import Gradebook

    results, workdir, *_ = graded
    for student in ("patch_at_top_level", "kernel_exit"):
        run = workdir / "runs" / CH.name / student
        with Gradebook(f"sqlite:///{run / 'gradebook.db'}") as gradebook:
            assert gradebook.find_submission_notebook(CH.notebook, CH.name, student).score == results[student].score
        assert (run / "feedback" / student / CH.name / f"{CH.notebook}.html").is_file()


def test_class_report_summarises_and_plots(graded):
    results, workdir, *_ = graded
    text = grading.class_report(workdir)
    assert f"{len(STUDENTS)} students" in text and "masked_softmax-visible" in text and "kernel_exit" in text
    assert (workdir / "report.png").stat().st_size > 1000


def test_a_killed_grading_run_completes_identically_when_rerun(graded, tmp_path):
    results, _, submissions, _ = graded
    few = write_submissions(tmp_path / "few", CH, {"zeros": CH.solved({MS: ZEROS})})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "course_lib.cli", "grade", str(few), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(12)  # well inside the first student's notebook
    import os
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    rerun = {r.student: r for r in grading.grade(few, out, cell_timeout=40, sandboxed=True)}
    assert verdicts(rerun["zeros"]) == verdicts(results["zeros"])
