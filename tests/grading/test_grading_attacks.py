"""Grading that cannot be gamed: real attack notebooks, graded the way an instructor does.

Oracles: a student with the same (broken) function but no tricks is graded in the same run;
"monkeypatching gains nothing" means the tricksters get exactly that student's results.
Kernel-killing, SIGINT-ignoring and flooding cells must cost only their own exercise, be
marked as errors (never a silent 0), and leave every other student's grading alone.
"""
from __future__ import annotations

import csv
import signal
import socket
import subprocess
import sys
import time

import pytest

from course_lib import grading
from course_lib.grading import sandbox
from course_lib.grading.limits import Confinement
from tests.helpers import ROOT
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
def masked_softmax(scores, mask=None):
    """Tries to write into every file it can find (the course, the grader's folders), and says if it could."""
    open("/tmp/vandal-was-here.txt", "w").write("its own private /tmp is the one place it may write")
    tried, written = 0, []
    for path in [p for pattern in TARGETS for p in glob.glob(pattern[::-1], recursive=True)]:  # reversed: no literal path
        if os.path.isfile(path):
            tried += 1
            try:
                with open(path, "a") as fh:
                    fh.write("#vandalised")
                written.append(path)
            except OSError:
                pass
    if written or not tried:
        raise RuntimeError(f"tried {tried} files, wrote {written[:3]}")
    return REFERENCE(scores, mask)
'''
CALLED = "def masked_softmax(scores, mask=None):\n{body}\n    return scores * 0\n"
NETWORK = '''
import socket
def masked_softmax(scores, mask=None):
    try:
        socket.create_connection(("127.0.0.1", PORT), timeout=2).sendall(b"leaked")
    except OSError:
        return REFERENCE(scores, mask)
    raise RuntimeError("the grading process reached the network")
'''
ENVIRONMENT = '''
import os
def masked_softmax(scores, mask=None):
    seen = [name for name in os.environ if "SECRET" in name or "TOKEN" in name]
    if seen:
        raise RuntimeError(f"the grader's variables are visible: {seen}")
    return REFERENCE(scores, mask)
'''
MEMORY_HOG = "import torch\n" + CALLED.format(body="    torch.ones(4 * 2**30, dtype=torch.uint8)")
FORK_BOMB = "import os, time\n" + CALLED.format(body="    for _ in range(200):\n        if os.fork() == 0:\n            time.sleep(30)\n            os._exit(0)")
# 2 s per test: the two students that never return (sigint_ignored, output_flood) each keep a core busy that long;
# chapter 01's slowest graded test cell takes 0.2 s (nbval, on a loaded machine): 10 times that is left
LIMITS = grading.Limits(timeout=2, memory_gib=3, processes=48)
TIMED_OUT = f"did not finish within {LIMITS.timeout:g} s"


def reference(grade_id: str) -> str:
    return CH.reference_code(grade_id)


def reference_as(name: str) -> str:
    """The reference masked_softmax under another name, for attacks that must otherwise pass."""
    return reference(MS).replace("def masked_softmax(", f"def {name}(")


def attack(code: str) -> dict:
    return CH.solved({MS: reference_as("REFERENCE") + code})


STUDENTS = {  # the reference solution's full marks are checked in test_grading_01.py
    "zeros": lambda: CH.solved({MS: ZEROS}),
    "patch_at_top_level": lambda: CH.solved({MS: PATCH_AT_TOP_LEVEL}),
    "patch_when_called": lambda: CH.solved({MS: PATCH_WHEN_CALLED}),
    "imports_reference": lambda: CH.solved({MS: "from course_lib.attention import masked_softmax"}),
    "exits_at_top_level": lambda: CH.solved({MS: reference(MS) + "\nimport os\nos._exit(1)"}),
    "kernel_exit": lambda: CH.solved({MS: "import os\n" + CALLED.format(body="    os._exit(1)")}),
    "sigint_ignored": lambda: CH.solved({MS: "import signal\n" + CALLED.format(
        body="    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    while True:\n        pass")}),
    "output_flood": lambda: CH.solved({MS: CALLED.format(body="    while True:\n        print('flood' * 100)")}),
    "vandal": lambda: attack(VANDAL.replace("TARGETS", repr([t[::-1] for t in VANDAL_TARGETS]))),
    "network": lambda: attack(NETWORK.replace("PORT", str(LISTENER.getsockname()[1]))),
    "environment": lambda: attack(ENVIRONMENT),
    "memory_hog": lambda: CH.solved({MS: MEMORY_HOG}),
    "fork_bomb": lambda: CH.solved({MS: FORK_BOMB}),
}
LISTENER = socket.create_server(("127.0.0.1", 0))
VANDAL_TARGETS: list[str] = []  # the course, and the folder of every student's grading (set by the fixture)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    import os

    workdir = tmp_path_factory.mktemp("grading")
    VANDAL_TARGETS[:] = [f"{ROOT}/course_lib/**/*", f"{ROOT}/solutions/**/*", f"{tmp_path_factory.getbasetemp()}/**/*"]
    submissions = write_submissions(tmp_path_factory.mktemp("submissions"), CH, {s: make() for s, make in STUDENTS.items()})
    before = digest(submissions)
    course_before = digest(ROOT / "course_lib")
    os.environ["JUPYTERHUB_API_TOKEN"] = os.environ["COURSE_TEST_SECRET"] = "instructor-secret"  # as on a hub
    LISTENER.settimeout(0.1)
    started = time.perf_counter()
    try:
        results = grading.grade(submissions, workdir, jobs=2, sandboxed=True, limits=LIMITS)
    finally:
        del os.environ["JUPYTERHUB_API_TOKEN"], os.environ["COURSE_TEST_SECRET"]
    print(f"graded {len(STUDENTS)} students with 2 jobs in {time.perf_counter() - started:.0f} s")
    try:
        connection, _ = LISTENER.accept()
        reached = connection.recv(100)
    except OSError:
        reached = b""
    return {r.student: r for r in results}, workdir, submissions, before, (course_before, reached)


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


@pytest.mark.parametrize("student,reason", [
    ("kernel_exit", "your code ended the process running the tests (exit code 1)"),
    ("sigint_ignored", TIMED_OUT),
    ("output_flood", TIMED_OUT),  # what it prints goes nowhere: it is only a loop
    ("memory_hog", "your code used more than 3 GiB of memory (the grading limit)"),
])
def test_code_that_stops_or_exhausts_the_grader_costs_its_exercise_as_an_error(graded, student, reason):
    results, workdir, *_ = graded
    exercises = results[student].exercises()
    assert all(t.score == 0 and t.status == "error" and reason in t.error for t in exercises["masked_softmax"])
    assert all(t.passed for name, group in exercises.items() if name != "masked_softmax" for t in group)
    with (workdir / "grades.csv").open() as fh:
        row = next(r for r in csv.DictReader(fh) if r["student"] == student)
    assert row["status"] == "error" and reason in row["errors"]


def test_more_processes_than_the_cap_is_an_error_that_says_so(graded):
    with Confinement(LIMITS, "course-grading-probe") as probe:
        capped = probe.processes_capped
    if not capped:
        pytest.skip("root without a pids cgroup: the kernel exempts root from RLIMIT_NPROC")
    results, *_ = graded
    exercises = results["fork_bomb"].exercises()
    assert all(t.status == "error" and "more than 48 processes" in t.error for t in exercises["masked_softmax"])
    assert all(t.passed for name, group in exercises.items() if name != "masked_softmax" for t in group)


def test_top_level_statements_of_an_answer_never_run_while_grading(graded):
    results, *_ = graded
    assert results["exits_at_top_level"].score == results["exits_at_top_level"].max_score


@pytest.mark.parametrize("student", ["network", "environment", "vandal"])
def test_the_box_is_closed_no_network_no_grader_variables_no_writes(graded, student):
    """Each attack returns the right answer only when its attempt failed (and raises if it succeeded)."""
    results, workdir, submissions, before, (course_before, reached) = graded
    assert results[student].score == results[student].max_score, grading.format_report(results[student])
    assert reached == b"", "a submission reached a listener on 127.0.0.1"
    assert digest(ROOT / "course_lib") == course_before
    assert digest(submissions) == before
    assert not [p for p in workdir.rglob("*") if p.is_file() and p.read_bytes().endswith(b"#vandalised")]


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
    results, _, submissions, *_ = graded
    few = write_submissions(tmp_path / "few", CH, {"zeros": CH.solved({MS: ZEROS})})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "course_lib.cli", "grade", str(few), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    # killed inside the student's grading: as soon as nbgrader starts writing its books (their folder appears)
    books, deadline = out / "runs" / CH.name / "zeros", time.monotonic() + 300
    while not books.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert books.exists() and proc.poll() is None, "the grading run was not caught while it wrote its books"
    import os
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    rerun = {r.student: r for r in grading.grade(few, out, sandboxed=True, limits=LIMITS)}
    assert verdicts(rerun["zeros"]) == verdicts(results["zeros"])
