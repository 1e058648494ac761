"""Grading a class: each learner's work tested in a clean room, recorded in nbgrader's books.

``grade`` never touches the submissions it is given. For each student it:

1. reads every chapter notebook against its source (``submission.py``): copied cells, cells with
   foreign nbgrader metadata and answers switched to markdown are forgiven, and noted;
2. runs all of that student's chapters in one clean room (``runner.py`` → ``cleanroom.py``): a
   fresh process in a closed box (no network, a clean environment, memory, process and time caps)
   that loads only the definitions of the answers and runs the source notebook's tests, each
   exercise with the reference versions of the others; the course's own demonstration cells
   (training, measurements) never run while grading, so a learner's course grades in seconds;
3. applies the static rule: an answer that uses ``course_lib`` (the reference code) scores 0;
4. records the verdicts in nbgrader's own gradebook and feedback (``books.py``), one course
   folder per student and chapter, ``<workdir>/runs/<chapter>/<student>/``.

An error (a test past the time limit, memory or processes over the cap, a process that died)
costs the exercise it happened in, marked as an error, and nothing else. ``check`` is ``grade``
for one learner's own notebook (no sandbox: it is the learner's own machine).
"""
from __future__ import annotations

import json
import multiprocessing
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

from . import books, sandbox
from .cleanroom import forbidden_use
from .course import CELL_TIMEOUT, RELEASE_DIR, SOURCE_DIR, chapters, repo_root, resolve_chapter
from .limits import Limits
from .reports import NotebookResult, TestResult, write_csvs
from .runner import chapter_job, run_cleanroom
from .submission import NotThisNotebook, exercise_of, nbgrader_meta, read_submission


def _points(source: dict) -> dict[str, float]:
    """grade_id -> points of every test cell of a source notebook, in notebook order."""
    return {nbgrader_meta(c)["grade_id"]: float(nbgrader_meta(c).get("points", 0))
            for c in source["cells"] if nbgrader_meta(c).get("grade")}


def _find_submitted(folder: Path, name: str, expected: int) -> tuple[Path | None, str]:
    """The submitted file for notebook ``name``; a chapter of one notebook accepts one file of any name."""
    exact = folder / f"{name}.ipynb"
    if exact.is_file():
        return exact, ""
    found = sorted(folder.glob("*.ipynb"))
    if expected == 1 and len(found) == 1:
        return found[0], f"{found[0].name} was graded as {name}.ipynb"
    return None, ""


class _Unit:
    """One chapter notebook of one student: its source, what was submitted, and how it reads."""

    def __init__(self, student: str, chapter: str, source_path: Path, submitted_folder: Path, expected: int):
        self.student, self.chapter, self.name = student, chapter, source_path.stem
        self.key = f"{chapter}/{self.name}"
        self.source = json.loads(source_path.read_text())
        self.result = NotebookResult(student, chapter, self.name)
        self.reading = None
        path, note = _find_submitted(submitted_folder, self.name, expected)
        if path is None:
            self.result.error = f"not graded: {self.name}.ipynb was not submitted"
            return
        try:
            submitted = json.loads(path.read_text())
            self.reading = read_submission(self.source, submitted)
        except NotThisNotebook as error:
            self.result.error = f"not graded: {path.name} is not this chapter's notebook: {error}"
            return
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            self.result.error = f"not graded: {path.name} is not a notebook that can be read ({type(error).__name__}: {error})"
            return
        self.result.notes = ([note] if note else []) + self.reading.notes

    def judge(self, verdicts) -> None:
        """Fill in the result's tests from the clean room's verdicts and the static rule."""
        charged: dict[str, str] = {}  # exercise -> the error that costs it
        for grade_id, answer in self.reading.answers.items():
            line = forbidden_use(answer or "")
            if line:
                charged.setdefault(exercise_of(grade_id), f"the solution uses the course's reference code ({line}); "
                                                          "solve the exercise with your own code")
        points = _points(self.source)
        for grade_id in points:
            verdict = verdicts[(self.key, grade_id)]
            if verdict.error:
                charged.setdefault(exercise_of(grade_id), verdict.error)
        for grade_id, max_score in points.items():
            verdict = verdicts[(self.key, grade_id)]
            error = charged.get(exercise_of(grade_id), "")
            passed = verdict.passed and not error
            message = error or ("" if passed else verdict.message or "failed")
            self.result.tests.append(TestResult(grade_id, max_score if passed else 0.0, max_score, message=message, error=error))


def _grade_student(student: str, chapter_names: list[str], submissions: Path, workdir: Path, root: Path,
                   templates: dict[str, Path], limits: Limits, sandboxed: bool, hidden: tuple[Path, ...],
                   feedback: bool) -> list[NotebookResult]:
    units = []
    for chapter in chapter_names:
        folder = submissions / student / chapter
        if not folder.is_dir():
            continue
        sources = sorted((root / SOURCE_DIR / chapter).glob("*.ipynb"))
        units += [_Unit(student, chapter, source, folder, len(sources)) for source in sources]
    readable = [u for u in units if u.reading is not None]
    log = workdir / "runs" / f"{student}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        jobs = [chapter_job(u.key, u.source, u.reading.answers) for u in readable if _points(u.source)]
        verdicts = run_cleanroom(jobs, limits, sandboxed, hidden, log=log) if jobs else {}
        for unit in readable:
            unit.judge(verdicts)
        for chapter in {u.chapter for u in readable}:
            _record(chapter, student, [u for u in readable if u.chapter == chapter], workdir, templates[chapter], feedback)
    except Exception as error:  # noqa: BLE001 - recorded as this student's error, grading goes on
        with log.open("a") as fh:
            fh.write(f"grading failed: {error!r}\n")
        for unit in readable:
            unit.result.tests, unit.result.error = [], f"not graded: {error}"
    return [u.result for u in units]


def _record(chapter: str, student: str, units: list[_Unit], workdir: Path, template: Path, feedback: bool) -> None:
    """nbgrader's gradebook (and feedback, if ``feedback``) for one student's chapter; they must agree with the results."""
    folder = workdir / "runs" / chapter / student
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(template, folder)
    verdicts = {t.grade_id: ("" if t.passed else t.message) for u in units for t in u.result.tests}
    notes = [note for u in units for note in u.result.notes]
    scores = books.autograde(folder, chapter, student, {u.name: u.reading.notebook for u in units}, verdicts, notes, feedback)
    for unit in units:
        ours = {t.grade_id: t.score for t in unit.result.tests}
        if scores[unit.name] != ours:
            raise RuntimeError(f"nbgrader's gradebook disagrees with the clean room for {unit.key}: {scores[unit.name]} != {ours}")


def grade_students(students: list[str], jobs: int, **options) -> list[NotebookResult]:
    """``_grade_student(student, **options)`` for each student, ``jobs`` at once, in worker processes
    when ``jobs`` > 1 (nbgrader's books are Python work: processes let them use every core too)."""
    one = partial(_grade_student, **options)
    if jobs == 1:
        return [r for student in students for r in one(student)]
    # fresh processes, never forks of this one (its threads may hold locks): forked from a fork server, which imports
    # nbgrader once for them all (seconds per process), as "spawn" would in each
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, *books.NBGRADER_MODULES])
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        return [r for batch in pool.map(one, students) for r in batch]


def grade(submissions: Path, workdir: Path, chapter_names: list[str] | None = None, cell_timeout: float = CELL_TIMEOUT,
          root: Path | None = None, jobs: int = 1, sandboxed: bool | None = None, limits: Limits | None = None,
          hide: tuple[Path, ...] = (), feedback: bool = True) -> list[NotebookResult]:
    """Autograde ``submissions/<student>/<chapter>/*.ipynb``; never modifies ``submissions``.

    Each student's chapters are tested in one clean room (sandboxed when bubblewrap is available:
    ``sandboxed=None`` means "if available") under ``limits`` (default: ``Limits(timeout=cell_timeout)``),
    with the grading folders, the submissions, the course's solutions and release, and ``hide`` hidden from it,
    and recorded in nbgrader's books in ``workdir/runs/<chapter>/<student>/`` (gradebook.db,
    autograded/, and feedback/ HTML unless not ``feedback``: a learner's own check, which prints its report and
    keeps no files, skips it). ``jobs`` students are graded at once. Writes workdir/grades.csv (one
    row per student and chapter, with a status column), grades_by_exercise.csv and grades_by_test.csv.
    Returns one NotebookResult per student notebook, by chapter, then student.
    """
    root = root or repo_root()
    submissions, workdir = Path(submissions).resolve(), Path(workdir).resolve()
    if not submissions.is_dir():
        raise ValueError(f"submissions must be a folder of <student>/<chapter>/*.ipynb, got {submissions}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    limits = limits or Limits(timeout=cell_timeout)
    if sandboxed is None:
        sandboxed = sandbox.available()
    elif sandboxed and not sandbox.available():
        raise ValueError("sandboxed=True needs bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)")
    students = sorted(p.name for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))
    wanted = chapter_names or [c for c in chapters(root) if any((submissions / s / c).is_dir() for s in students)]
    workdir.mkdir(parents=True, exist_ok=True)
    templates = {chapter: books.prepare_template(root, workdir, chapter) for chapter in wanted}
    results = grade_students(students, jobs, chapter_names=wanted, submissions=submissions, workdir=workdir, root=root,
                             templates=templates, limits=limits, sandboxed=sandboxed, feedback=feedback,
                             hidden=(workdir / "runs", workdir / "templates", submissions, root / SOURCE_DIR, root / RELEASE_DIR,
                                     *hide))
    order = {chapter: i for i, chapter in enumerate(wanted)}
    results.sort(key=lambda r: (order[r.chapter], r.student, r.notebook))
    write_csvs(results, workdir)
    return results


def own_notebooks(chapter: str, root: Path) -> list[Path]:
    """The learner's notebooks of ``chapter``: fetched on a hub into ``./<chapter>/`` (nbgrader's Assignments
    tab puts them there), or else the course's ``notebooks/<chapter>/``."""
    fetched = sorted((Path.cwd() / chapter).glob("*.ipynb"))
    return fetched or sorted((root / RELEASE_DIR / chapter).glob("*.ipynb"))


def check(chapter_spec: str, notebook: Path | None = None, workdir: Path | None = None) -> list[NotebookResult]:
    """Grade the learner's own notebook(s) of one chapter against the hidden tests (a copy is graded):
    ``notebook``, or else ``own_notebooks(chapter)``."""
    root = repo_root()
    chapter = resolve_chapter(chapter_spec, root)
    notebooks = [Path(notebook)] if notebook else own_notebooks(chapter, root)
    if not notebooks or not all(p.is_file() for p in notebooks):
        raise ValueError(f"notebook not found: {notebook or root / RELEASE_DIR / chapter}")
    with tempfile.TemporaryDirectory(prefix="course-check-") as tmp:
        submissions = Path(tmp) / "submitted" / "you" / chapter
        submissions.mkdir(parents=True)
        for path in notebooks:
            shutil.copy2(path, submissions / path.name)
        # your own notebook on your own machine: no sandbox needed; the report is printed, so no feedback HTML
        return grade(Path(tmp) / "submitted", Path(workdir or Path(tmp) / "work"), [chapter], root=root, sandboxed=False,
                     feedback=workdir is not None)
