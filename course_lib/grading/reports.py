"""What grading found, for people: per-test results, the CSVs, the class report, the learner's report."""
from __future__ import annotations

import csv
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from .submission import exercise_of

@dataclass
class TestResult:
    """One graded test cell of one submission."""

    grade_id: str
    score: float
    max_score: float
    message: str = ""  # why the test failed ("" when it passed)
    error: str = ""  # set when the exercise could not be graded normally (time limit, memory or process cap, process died)

    @property
    def exercise(self) -> str:
        return exercise_of(self.grade_id)

    @property
    def passed(self) -> bool:
        return not self.error and self.score >= self.max_score

    @property
    def status(self) -> str:
        return "error" if self.error else "passed" if self.passed else "failed"


@dataclass
class NotebookResult:
    """The grading of one student's notebook for one chapter."""

    student: str
    chapter: str
    notebook: str
    tests: list[TestResult] = field(default_factory=list)
    error: str = ""  # set when the notebook could not be graded at all
    notes: list[str] = field(default_factory=list)  # what grading ignored or repaired ("a copy of ... was ignored")

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


def write_csvs(results: list[NotebookResult], workdir: Path) -> None:
    """grades.csv (student x chapter), grades_by_exercise.csv and grades_by_test.csv; errors are never a bare 0."""
    def rows(path, header, body):
        with Path(path).open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(header)
            writer.writerows(body)

    rows(workdir / "grades.csv", ["student", "chapter", "notebook", "score", "max_score", "status", "errors", "notes"],
         [[r.student, r.chapter, r.notebook, r.score, r.max_score, "error" if r.error or any(t.error for t in r.tests) else "graded",
           r.error or "; ".join(sorted({f"{t.exercise}: {t.error}" for t in r.tests if t.error})), "; ".join(r.notes)]
          for r in results])
    rows(workdir / "grades_by_exercise.csv", ["student", "chapter", "exercise", "score", "max_score", "status", "message"],
         [[r.student, r.chapter, exercise, sum(t.score for t in tests), sum(t.max_score for t in tests),
           "error" if any(t.error for t in tests) else "passed" if all(t.passed for t in tests) else "failed",
           next((t.error for t in tests if t.error), "")]
          for r in results for exercise, tests in r.exercises().items()]
         + [[r.student, r.chapter, "", 0, "", "error", r.error] for r in results if r.error])
    rows(workdir / "grades_by_test.csv", ["student", "chapter", "exercise", "test", "score", "max_score", "status", "message"],
         [[r.student, r.chapter, t.exercise, t.grade_id, t.score, t.max_score, t.status, t.message] for r in results for t in r.tests]
         + [[r.student, r.chapter, "", "", 0, "", "error", r.error] for r in results if r.error])


def class_report(workdir: Path) -> str:
    """Class summary from grades_by_test.csv: mean score per exercise, the tests that fail most; draws report.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(workdir) / "grades_by_test.csv"
    if not path.is_file():
        raise ValueError(f"workdir must be a folder written by `course grade`; {path} does not exist")
    with path.open() as fh:
        rows = [r for r in csv.DictReader(fh) if r["test"]]
    students = sorted({r["student"] for r in rows})
    exercises: dict[tuple[str, str], list[float]] = {}
    failures: dict[tuple[str, str], list[bool]] = {}
    for r in rows:
        exercises.setdefault((r["chapter"], r["exercise"]), []).append(float(r["score"]) / float(r["max_score"]))
        failures.setdefault((r["chapter"], r["test"]), []).append(r["status"] != "passed")
    lines = [f"{len(students)} students", "", "mean score per exercise:"]
    for (chapter, exercise), fractions in exercises.items():
        lines.append(f"  {chapter:<16} {exercise:<34} {sum(fractions) / len(fractions):6.1%}")
    ranked = sorted(failures.items(), key=lambda item: -sum(item[1]) / len(item[1]))
    lines += ["", "tests failed most often:"]
    lines += [f"  {chapter:<16} {test:<44} {sum(failed)}/{len(failed)} students" for (chapter, test), failed in ranked[:10] if any(failed)]
    errors = sorted({(r["student"], r["chapter"], r["message"]) for r in rows if r["status"] == "error"})
    if errors:
        lines += ["", "errors (not graded normally):"] + [f"  {s} {c}: {m}" for s, c, m in errors]
    shown = ranked[:15]
    figure, ax = plt.subplots(figsize=(7.0, 0.35 * len(shown) + 1.2))
    ax.barh([test for (_, test), _ in shown][::-1], [sum(f) / len(f) for _, f in shown][::-1], color="tab:red")
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction of students failing")
    ax.set_title("tests that fail most")
    figure.tight_layout()
    figure.savefig(Path(workdir) / "report.png", dpi=90)
    plt.close(figure)
    lines.append(f"\nwrote {Path(workdir) / 'report.png'}")
    return "\n".join(lines)


REPORT_WIDTH = 120


def _wrapped(message: str, indent: str = " " * 8) -> list[str]:
    """A test's whole message, each of its lines wrapped to the report's width under its test (never cut)."""
    return [textwrap.fill(line, REPORT_WIDTH, initial_indent=indent, subsequent_indent=indent,
                          break_long_words=False, break_on_hyphens=False) or indent.rstrip()
            for line in message.splitlines()]


def format_report(result: NotebookResult) -> str:
    """A per-exercise report with points, and the reason each failed test gave."""
    lines = [f"{result.chapter}/{result.notebook}.ipynb ({result.student})"]
    if result.error:
        return "\n".join(lines + [f"  ERROR: {result.error}"])
    lines += [f"  note: {note}" for note in result.notes]
    if not result.tests:
        return "\n".join(lines + ["  this chapter has no graded exercises"])
    lines.append("  (each exercise is tested with the course's own versions of the other exercises: a mistake costs only its own points)")
    for exercise, tests in result.exercises().items():
        score, max_score = sum(t.score for t in tests), sum(t.max_score for t in tests)
        errors = {t.error for t in tests if t.error}
        lines.append(f"  {exercise:<34} {score:g} / {max_score:g}" + (f"   ERROR: {errors.pop()}" if errors else ""))
        if any(t.error for t in tests):
            continue
        for t in tests:
            mark = "✓" if t.passed else "✗"
            line = f"    {mark} {t.grade_id:<38} {t.score:g} / {t.max_score:g}"
            lines.append(line + "".join(f"\n{text}" for text in _wrapped(t.message)))
    lines.append(f"  {'total':<34} {result.score:g} / {result.max_score:g}")
    return "\n".join(lines)
