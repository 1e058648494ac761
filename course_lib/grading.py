"""Grading: thin wrappers around nbgrader's own commands and gradebook.

Layout (nbgrader's names in brackets)::

    solutions/NN-name/*.ipynb   reference notebooks [source]
    notebooks/NN-name/*.ipynb   student release     [release]

``release`` regenerates notebooks/ in place. ``grade`` never touches the submissions
it is given: it copies them into a work directory laid out the way nbgrader expects
(``submitted/<student>/<chapter>/``), runs ``nbgrader autograde``, ``generate_feedback``
and ``export`` there, and reads per-test scores from nbgrader's SQLite gradebook.
``check`` is ``grade`` for one learner and one chapter.

Test cells are named ``<exercise>-<what it checks>`` (nbgrader ``grade_id``); the part
before the first ``-`` groups tests into exercises in the reports.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

COURSE_ID = "attention-to-decoding"
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
#: seconds one cell may run while grading before it is interrupted and scored as an error
CELL_TIMEOUT = 120
SOURCE_DIR = "solutions"
RELEASE_DIR = "notebooks"


def configure(c, cell_timeout: int = CELL_TIMEOUT) -> None:
    """Apply the course's nbgrader settings to a traitlets config object ``c``."""
    c.CourseDirectory.course_id = COURSE_ID
    c.CourseDirectory.source_directory = SOURCE_DIR
    c.CourseDirectory.release_directory = RELEASE_DIR
    c.ClearSolutions.code_stub = {"python": CODE_STUB}
    c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
    c.Execute.timeout = cell_timeout
    # A deleted test cell is put back from the gradebook instead of silently scoring nothing.
    c.OverwriteCells.add_missing_cells = True


def repo_root() -> Path:
    """The course repository this package was installed from (it holds solutions/)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / SOURCE_DIR).is_dir():
        raise RuntimeError(f"cannot find the course's {SOURCE_DIR}/ folder next to {root / 'course_lib'}; "
                           "install the course with `pip install -e .` from its repository")
    return root


def chapters(root: Path | None = None) -> list[str]:
    """All chapter folder names, in order: ['00-orientation', '01-attention', ...]."""
    source = (root or repo_root()) / SOURCE_DIR
    return sorted(p.name for p in source.iterdir() if p.is_dir() and p.name[:2].isdigit())


def resolve_chapter(spec: str, root: Path | None = None) -> str:
    """'1', '01' or '01-attention' -> '01-attention'."""
    names = chapters(root)
    if spec in names:
        return spec
    if spec.isdigit():
        matches = [n for n in names if n.startswith(f"{int(spec):02d}-")]
        if matches:
            return matches[0]
    raise ValueError(f"chapter must be one of {', '.join(n[:2] for n in names)} (or a full name such as {names[-1]!r}), got {spec!r}")


def _config_text(cell_timeout: int) -> str:
    return ("from course_lib.grading import configure\n"
            f"configure(get_config(), cell_timeout={cell_timeout})  # noqa: F821\n")


def run_nbgrader(args: list[str], cwd: Path, log: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``nbgrader ARGS`` in ``cwd`` with this interpreter; raise with the log tail on failure."""
    # nbgrader runs helper executables (alembic) by name: put this interpreter's bin/ first on PATH
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=cwd, capture_output=True, text=True, env=env)
    if log is not None:
        with log.open("a") as fh:
            fh.write(f"$ nbgrader {' '.join(args)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"nbgrader {' '.join(args)} failed (exit {proc.returncode}):\n{tail}")
    return proc


def release(chapter_names: list[str] | None = None, root: Path | None = None) -> list[Path]:
    """Regenerate ``notebooks/<chapter>/`` from ``solutions/<chapter>/`` with nbgrader; returns the folders."""
    root = root or repo_root()
    names = chapter_names or chapters(root)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "nbgrader_config.py"
        config.write_text(_config_text(CELL_TIMEOUT))
        for name in names:
            # nbgrader reads nbgrader_config.py from its working directory
            run_nbgrader(["generate_assignment", name, "--force", "--no-db", f"--CourseDirectory.root={root}"], cwd=Path(tmp))
            out.append(root / RELEASE_DIR / name)
    return out


# --- grading --------------------------------------------------------------------------

@dataclass
class TestResult:
    """One graded test cell of one submission."""

    grade_id: str
    score: float
    max_score: float
    message: str = ""  # the error the test raised, "" when it passed

    @property
    def exercise(self) -> str:
        return self.grade_id.split("-", 1)[0]

    @property
    def passed(self) -> bool:
        return self.score >= self.max_score


@dataclass
class NotebookResult:
    """The grading of one student's notebook for one chapter."""

    student: str
    chapter: str
    notebook: str
    tests: list[TestResult] = field(default_factory=list)
    error: str = ""  # set when the notebook could not be graded at all

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_score for t in self.tests)

    def exercises(self) -> dict[str, list[TestResult]]:
        grouped: dict[str, list[TestResult]] = {}
        for test in self.tests:
            grouped.setdefault(test.exercise, []).append(test)
        return grouped


def _error_messages(autograded: Path) -> dict[str, str]:
    """grade_id -> 'ExceptionName: message' for every graded cell that raised."""
    messages = {}
    notebook = json.loads(autograded.read_text())
    for cell in notebook["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if not meta.get("grade"):
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                messages[meta["grade_id"]] = f"{output['ename']}: {output['evalue']}".strip()
    return messages


def _collect(workdir: Path, chapter: str, students: list[str]) -> list[NotebookResult]:
    from nbgrader.api import Gradebook, MissingEntry

    results = []
    with Gradebook(f"sqlite:///{workdir / 'gradebook.db'}") as gradebook:
        assignment = gradebook.find_assignment(chapter)
        for student in students:
            for notebook in assignment.notebooks:
                result = NotebookResult(student, chapter, notebook.name)
                autograded = workdir / "autograded" / student / chapter / f"{notebook.name}.ipynb"
                try:
                    submission = gradebook.find_submission_notebook(notebook.name, chapter, student)
                except MissingEntry:
                    submission = None
                if submission is None or not autograded.exists():
                    result.error = "not graded: see grading.log"
                    results.append(result)
                    continue
                messages = _error_messages(autograded)
                for grade in sorted(submission.grades, key=lambda g: g.cell_id if hasattr(g, "cell_id") else g.name):
                    result.tests.append(TestResult(grade.name, float(grade.score), float(grade.max_score), messages.get(grade.name, "")))
                order = _grade_order(workdir / SOURCE_DIR / chapter / f"{notebook.name}.ipynb")
                result.tests.sort(key=lambda t: order.get(t.grade_id, len(order)))
                results.append(result)
    return results


def _grade_order(source_notebook: Path) -> dict[str, int]:
    cells = json.loads(source_notebook.read_text())["cells"]
    ids = [c["metadata"]["nbgrader"]["grade_id"] for c in cells if c.get("metadata", {}).get("nbgrader", {}).get("grade")]
    return {grade_id: i for i, grade_id in enumerate(ids)}


def grade(submissions: Path, workdir: Path, chapter_names: list[str] | None = None, cell_timeout: int = CELL_TIMEOUT,
          root: Path | None = None) -> list[NotebookResult]:
    """Autograde ``submissions/<student>/<chapter>/*.ipynb`` in ``workdir``; never modifies ``submissions``.

    Writes workdir/gradebook.db, autograded/, feedback/ (HTML), grades.csv (nbgrader's
    export: one row per student and chapter) and grades_by_test.csv (one row per student,
    chapter and test cell). Returns one NotebookResult per student notebook.
    """
    root = root or repo_root()
    submissions, workdir = Path(submissions).resolve(), Path(workdir).resolve()
    if not submissions.is_dir():
        raise ValueError(f"submissions must be a folder of <student>/<chapter>/*.ipynb, got {submissions}")
    students = sorted(p.name for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))
    wanted = chapter_names or [c for c in chapters(root) if any((submissions / s / c).is_dir() for s in students)]
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "nbgrader_config.py").write_text(_config_text(cell_timeout))
    log = workdir / "grading.log"
    results = []
    for chapter in wanted:
        shutil.rmtree(workdir / SOURCE_DIR / chapter, ignore_errors=True)
        shutil.copytree(root / SOURCE_DIR / chapter, workdir / SOURCE_DIR / chapter)
        run_nbgrader(["generate_assignment", chapter, "--force"], cwd=workdir, log=log)
        graded = []
        for student in students:
            src = submissions / student / chapter
            if not src.is_dir():
                continue
            dst = workdir / "submitted" / student / chapter
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)
            graded.append(student)
        if not graded:
            continue
        run_nbgrader(["autograde", chapter, "--force"], cwd=workdir, log=log)
        run_nbgrader(["generate_feedback", chapter, "--force"], cwd=workdir, log=log)
        results += _collect(workdir, chapter, graded)
    run_nbgrader(["export", "--to", str(workdir / "grades.csv")], cwd=workdir, log=log)
    write_test_csv(results, workdir / "grades_by_test.csv")
    return results


def write_test_csv(results: list[NotebookResult], path: Path) -> None:
    """One row per student, chapter and test cell (status: passed, failed or error)."""
    with Path(path).open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["student", "chapter", "exercise", "test", "score", "max_score", "status", "message"])
        for r in results:
            if r.error:
                writer.writerow([r.student, r.chapter, "", "", 0, "", "error", r.error])
            for t in r.tests:
                writer.writerow([r.student, r.chapter, t.exercise, t.grade_id, t.score, t.max_score,
                                 "passed" if t.passed else "failed", t.message])


def format_report(result: NotebookResult) -> str:
    """A per-exercise report with points, and the reason each failed test gave."""
    lines = [f"{result.chapter}/{result.notebook}.ipynb ({result.student})"]
    if result.error:
        return "\n".join(lines + [f"  ERROR: {result.error}"])
    if not result.tests:
        return "\n".join(lines + ["  this chapter has no graded exercises"])
    for exercise, tests in result.exercises().items():
        score, max_score = sum(t.score for t in tests), sum(t.max_score for t in tests)
        lines.append(f"  {exercise:<34} {score:g} / {max_score:g}")
        for t in tests:
            mark = "✓" if t.passed else "✗"
            line = f"    {mark} {t.grade_id:<38} {t.score:g} / {t.max_score:g}"
            if t.message:
                message = t.message if len(t.message) <= 200 else t.message[:197] + "..."
                line += f"\n        {message}"
            lines.append(line)
    lines.append(f"  {'total':<34} {result.score:g} / {result.max_score:g}")
    return "\n".join(lines)


def check(chapter_spec: str, notebook: Path | None = None, workdir: Path | None = None) -> list[NotebookResult]:
    """Grade the learner's own notebook(s) of one chapter against the hidden tests (a copy is graded)."""
    root = repo_root()
    chapter = resolve_chapter(chapter_spec, root)
    notebooks = [Path(notebook)] if notebook else sorted((root / RELEASE_DIR / chapter).glob("*.ipynb"))
    if not notebooks or not all(p.is_file() for p in notebooks):
        raise ValueError(f"notebook not found: {notebook or root / RELEASE_DIR / chapter}")
    with tempfile.TemporaryDirectory(prefix="course-check-") as tmp:
        submissions = Path(tmp) / "submitted" / "you" / chapter
        submissions.mkdir(parents=True)
        for path in notebooks:
            shutil.copy2(path, submissions / path.name)
        return grade(Path(tmp) / "submitted", Path(workdir or Path(tmp) / "work"), [chapter], root=root)
