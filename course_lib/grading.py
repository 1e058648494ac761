"""Grading: thin wrappers around nbgrader's own commands and gradebook, hardened.

Layout (nbgrader's names in brackets)::

    solutions/NN-name/*.ipynb   reference notebooks [source]
    notebooks/NN-name/*.ipynb   student release     [release]

``release`` regenerates notebooks/ in place. ``grade`` never touches the submissions it
is given. For each student and chapter it copies the submission into a course folder of
its own, ``<workdir>/runs/<chapter>/<student>/`` (nbgrader's gradebook.db, autograded/,
feedback/ and grades.csv live there), and runs ``nbgrader autograde`` with:

* the kernel in a bubblewrap sandbox (``course_lib.sandbox``): it can write only its own
  autograded folder, so no gradebook and no other student's file can change;
* ``GuardedExecute``: a trusted record of which cell runs, and an output budget per cell;
  a cell that kills the kernel, ignores interrupts or floods the output is defused and
  the notebook graded again; that cell's exercise scores 0 and is reported as an error;
* a static rule: a solution that uses ``course_lib`` scores 0 for its exercise;
* ``course_lib.recheck``: every test is run again outside the student's kernel, and a
  test passes only if it passes in both places, so monkeypatching gains nothing.

Overrides are written into nbgrader's gradebook as manual scores, so nbgrader's feedback
and export agree with ``grades_by_test.csv``. ``check`` is ``grade`` for one learner and
one chapter (no sandbox: it is the learner's own notebook).

Test cells are named ``<exercise>-<what it checks>`` (nbgrader ``grade_id``); the part
before the first ``-`` groups tests into exercises in the reports.
"""
from __future__ import annotations

import ast
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .recheck import forbidden_use, recheck

COURSE_ID = "attention-to-decoding"
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
#: seconds one cell may run while grading before it is interrupted and scored as an error
CELL_TIMEOUT = 120
SOURCE_DIR = "solutions"
RELEASE_DIR = "notebooks"


def configure(c, cell_timeout: int = CELL_TIMEOUT, progress_file: str = "", sandbox: bool = False) -> None:
    """Apply the course's nbgrader settings to a traitlets config object ``c``.

    progress_file and sandbox are set by ``grade`` for its own runs: cells are executed by
    ``GuardedExecute`` (which records progress and caps output), in the bubblewrap kernel
    when ``sandbox`` is True.
    """
    c.CourseDirectory.course_id = COURSE_ID
    c.CourseDirectory.source_directory = SOURCE_DIR
    c.CourseDirectory.release_directory = RELEASE_DIR
    c.ClearSolutions.code_stub = {"python": CODE_STUB}
    c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
    c.Execute.timeout = cell_timeout
    # A deleted test cell is put back from the gradebook instead of silently scoring nothing.
    c.OverwriteCells.add_missing_cells = True
    if progress_file:
        from nbgrader.converters import Autograde
        from nbgrader.preprocessors import Execute

        from .guarded_execute import GuardedExecute

        default = Autograde.class_traits()["autograde_preprocessors"].default()
        c.Autograde.autograde_preprocessors = [GuardedExecute if p is Execute else p for p in default]
        c.GuardedExecute.progress_file = progress_file
    if sandbox:
        from .sandbox import KERNEL_NAME

        c.Execute.kernel_name = KERNEL_NAME


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


def _config_text(cell_timeout: int, **options) -> str:
    arguments = "".join(f", {name}={value!r}" for name, value in options.items())
    return ("from course_lib.grading import configure\n"
            f"configure(get_config(), cell_timeout={cell_timeout}{arguments})  # noqa: F821\n")


def run_nbgrader(args: list[str], cwd: Path, log: Path | None = None, check: bool = True,
                 jupyter_path: Path | None = None, hide: list[Path] = ()) -> subprocess.CompletedProcess:
    """Run ``nbgrader ARGS`` in ``cwd`` with this interpreter; with ``check``, raise with the log tail on failure."""
    # nbgrader runs helper executables (alembic) by name: put this interpreter's bin/ first on PATH
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    if jupyter_path is not None:  # where the sandbox kernel spec is
        env["JUPYTER_PATH"] = os.pathsep.join([str(jupyter_path), os.environ.get("JUPYTER_PATH", "")])
    if hide:  # what the sandboxed kernel must not see
        from .sandbox import HIDE_ENV

        env[HIDE_ENV] = os.pathsep.join(str(p) for p in hide)
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=cwd, capture_output=True, text=True, env=env)
    if log is not None:
        with log.open("a") as fh:
            fh.write(f"$ nbgrader {' '.join(args)}\n{proc.stdout}{proc.stderr}\n")
    if check and proc.returncode != 0:
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


def execute_solutions(chapter_names: list[str] | None = None, root: Path | None = None, timeout: int = 600) -> list[Path]:
    """Re-execute reference notebooks in place so their stored outputs are current (for nbval).

    No per-cell timing metadata is stored: it would change on every run and leak into the release.
    """
    import nbformat
    from nbclient import NotebookClient

    root = root or repo_root()
    done = []
    for name in chapter_names or chapters(root):
        for path in sorted((root / SOURCE_DIR / name).glob("*.ipynb")):
            notebook = nbformat.read(path, as_version=4)
            NotebookClient(notebook, timeout=timeout, kernel_name="python3", record_timing=False,
                           resources={"metadata": {"path": str(path.parent)}}).execute()
            for cell in notebook.cells:
                cell.metadata.pop("execution", None)
            nbformat.write(notebook, path)
            done.append(path)
    return done


# --- grading ---------------------------------------------------------------------------

#: a notebook whose kernel dies or will not stop is re-graded with the offending cell
#: replaced, at most this many times
MAX_QUARANTINES = 5


@dataclass
class TestResult:
    """One graded test cell of one submission."""

    grade_id: str
    score: float
    max_score: float
    message: str = ""  # why the test failed ("" when it passed)
    error: str = ""  # set when the exercise could not be graded normally (kernel died, flood, ...)

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


def exercise_of(grade_id: str) -> str:
    """'masked_softmax-mask' -> 'masked_softmax'."""
    return grade_id.split("-", 1)[0]


def _nbgrader_meta(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _error_messages(autograded: Path) -> dict[str, str]:
    """grade_id -> 'ExceptionName: message' for every graded cell that raised."""
    messages = {}
    for cell in json.loads(autograded.read_text())["cells"]:
        meta = _nbgrader_meta(cell)
        if not meta.get("grade"):
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                messages[meta["grade_id"]] = f"{output['ename']}: {output['evalue']}".strip()
    return messages


def _grade_order(source_notebook: Path) -> dict[str, int]:
    cells = json.loads(source_notebook.read_text())["cells"]
    return {_nbgrader_meta(c)["grade_id"]: i for i, c in enumerate(cells) if _nbgrader_meta(c).get("grade")}


# --- what a submission may not do ------------------------------------------------------

def reference_imports(submitted: Path, source: Path) -> dict[str, str]:
    """exercise -> the offending line, for exercises whose solution uses course_lib.

    A solution cell may not use course_lib at all. A cell the student added (or changed)
    outside the solution cells may not import an exercise's name from course_lib either.
    """
    source_cells = json.loads(source.read_text())["cells"]
    exercises = {exercise_of(_nbgrader_meta(c)["grade_id"]) for c in source_cells if _nbgrader_meta(c).get("solution")}
    original = {"".join(c["source"]) for c in source_cells if c["cell_type"] == "code" and not _nbgrader_meta(c)}
    found: dict[str, str] = {}
    for cell in json.loads(submitted.read_text())["cells"]:
        meta, text = _nbgrader_meta(cell), "".join(cell.get("source", ""))
        if cell.get("cell_type") != "code" or meta.get("grade") or text in original:
            continue
        line = forbidden_use(text)
        if not line:
            continue
        if meta.get("solution"):
            found.setdefault(exercise_of(meta["grade_id"]), line)
        else:
            for exercise in exercises:
                if exercise in text or "*" in line:
                    found.setdefault(exercise, line)
    return found


# --- one student, one chapter ------------------------------------------------------------

def _progress(progress_file: Path) -> tuple[str | None, set[str]]:
    """(id of the cell that started but never finished, ids of cells that flooded their output)."""
    running, flooded = None, set()
    if progress_file.exists():
        for line in progress_file.read_text().splitlines():
            event, _, cell_id = line.partition(" ")
            if event == "start":
                running = cell_id
            elif event == "done":
                running = None
            elif event == "flood":
                flooded.add(cell_id)
    return running, flooded


def _failure_reason(output: str, cell_timeout: int, flooded: bool = False) -> str:
    if flooded:
        return "this cell printed more output than grading allows"
    if "DeadKernelError" in output or "Kernel died" in output:
        return "the kernel died or exited while running this cell"
    if "CellTimeoutError" in output or "UnresponsiveKernelError" in output or "TimeoutError" in output:
        return f"this cell did not finish within {cell_timeout} s and did not stop when interrupted"
    return "this cell stopped the grading (see grading.log)"


def definitions_only(source: str) -> str:
    """The imports, functions and classes of a cell, without the statements that run at the top level."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    kept = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))]
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


def _quarantine(notebooks: list[Path], cell_id: str, reason: str, course_cells: set[str]) -> str | None:
    """Defuse the offending cell of the submitted copy; return the exercise charged for it (None: no exercise).

    First time: keep only the cell's definitions (a crash at the top level then spares the
    functions later exercises call). If the cell is the culprit again: replace it entirely.
    """
    for path in notebooks:
        notebook = json.loads(path.read_text())
        cells = notebook["cells"]
        for index, cell in enumerate(cells):
            if cell.get("id") != cell_id:
                continue
            meta = _nbgrader_meta(cell)
            exercise = exercise_of(meta["grade_id"]) if meta.get("grade_id") else None
            if meta.get("grade"):  # a test cell is restored by nbgrader: stop the solution it calls instead
                targets = [c for c in cells if _nbgrader_meta(c).get("grade_id") == f"{exercise}-solution"]
            else:
                targets = [cell]
                if exercise is None and cell_id not in course_cells:  # a cell the student added: charge the exercise above it
                    above = [_nbgrader_meta(c)["grade_id"] for c in cells[:index] if _nbgrader_meta(c).get("solution")]
                    exercise = exercise_of(above[-1]) if above else None
            stopped = f"raise RuntimeError({('course grade stopped this cell: ' + reason)!r})"
            for target in targets:
                text = "".join(target["source"])
                defined = definitions_only(text)
                first_time = not text.startswith("raise RuntimeError(") and "# defused by course grade" not in text
                target["source"] = f"# defused by course grade: {reason}\n{defined}" if first_time and defined and defined != text else stopped
                target["outputs"] = []
            path.write_text(json.dumps(notebook, indent=1))
            return exercise
    return None


def _override(gradebook_url: str, chapter: str, student: str, notebook: str, grade_id: str, reason: str) -> None:
    """Score one test 0 in nbgrader's own gradebook (manual score) and say why in a comment."""
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(gradebook_url) as gradebook:
        grade = gradebook.find_grade(grade_id, notebook, chapter, student)
        grade.manual_score = 0.0
        try:
            gradebook.find_comment(grade_id, notebook, chapter, student).manual_comment = reason
        except MissingEntry:
            pass
        gradebook.db.commit()


@dataclass
class _Run:
    """Everything about grading one student's chapter in its own folder."""

    chapter: str
    student: str
    folder: Path
    cell_timeout: int
    sandboxed: bool
    hide: tuple[Path, ...] = ()  # folders the sandbox hides: every student's work and the gradebooks

    @property
    def progress_file(self) -> Path:
        return self.folder / "progress.log"

    @property
    def log(self) -> Path:
        return self.folder / "grading.log"

    @property
    def gradebook_url(self) -> str:
        return f"sqlite:///{self.folder / 'gradebook.db'}"

    def nbgrader(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run_nbgrader(list(args), cwd=self.folder, log=self.log, check=check,
                            jupyter_path=self.folder / "jupyter" if self.sandboxed else None,
                            hide=list(self.hide) if self.sandboxed else [])

    def submitted(self) -> list[Path]:
        return sorted((self.folder / "submitted" / self.student / self.chapter).glob("*.ipynb"))

    def autograded(self, notebook: str) -> Path:
        return self.folder / "autograded" / self.student / self.chapter / f"{notebook}.ipynb"


def _prepare_template(root: Path, workdir: Path, chapter: str) -> Path:
    """A course folder with the chapter's source and a gradebook that knows its cells."""
    template = workdir / "templates" / chapter
    shutil.rmtree(template, ignore_errors=True)
    template.mkdir(parents=True)
    shutil.copytree(root / SOURCE_DIR / chapter, template / SOURCE_DIR / chapter)
    (template / "nbgrader_config.py").write_text(_config_text(CELL_TIMEOUT))
    run_nbgrader(["generate_assignment", chapter, "--force"], cwd=template, log=workdir / "templates" / "grading.log")
    return template


def _strip_meaningless_metadata(path: Path) -> None:
    """Drop nbgrader metadata without a grade_id from a submitted copy (nbgrader 0.9.6 crashes on it)."""
    try:
        notebook = json.loads(path.read_text())
    except ValueError:
        return  # nbgrader will report the broken notebook
    changed = False
    for cell in notebook.get("cells", []):
        meta = cell.get("metadata", {})
        if "nbgrader" in meta and "grade_id" not in meta["nbgrader"]:
            del meta["nbgrader"]
            changed = True
    if changed:
        path.write_text(json.dumps(notebook, indent=1))


def _grade_one(template: Path, submission: Path, run: _Run) -> list[NotebookResult]:
    """Autograde one student's chapter in its own folder; a broken notebook never stops the others."""
    try:
        return _grade_in_folder(template, submission, run)
    except Exception as error:  # noqa: BLE001 - recorded as this student's error, grading goes on
        with run.log.open("a") as fh:
            fh.write(f"grading failed: {error!r}\n")
        names = sorted(p.stem for p in (template / SOURCE_DIR / run.chapter).glob("*.ipynb"))
        return [NotebookResult(run.student, run.chapter, name, error=f"not graded: {error}") for name in names]


def _grade_in_folder(template: Path, submission: Path, run: _Run) -> list[NotebookResult]:
    shutil.rmtree(run.folder, ignore_errors=True)
    shutil.copytree(template, run.folder)
    (run.folder / "nbgrader_config.py").write_text(
        _config_text(run.cell_timeout, progress_file=str(run.progress_file), sandbox=run.sandboxed))
    if run.sandboxed:
        from .sandbox import write_kernel_spec

        write_kernel_spec(run.folder / "jupyter")
    shutil.copytree(submission, run.folder / "submitted" / run.student / run.chapter)
    for path in run.submitted():
        _strip_meaningless_metadata(path)
    # the kernel may write only in its own autograded folder
    sources = sorted((run.folder / SOURCE_DIR / run.chapter).glob("*.ipynb"))
    course_cells = {c.get("id") for s in sources for c in json.loads(s.read_text())["cells"]}
    charged: dict[str, str] = {}  # exercise -> why it could not be graded
    notebook_error = ""
    for _ in range(MAX_QUARANTINES + 1):
        run.progress_file.unlink(missing_ok=True)
        proc = run.nbgrader("autograde", run.chapter, "--student", run.student, "--force", check=False)
        if proc.returncode == 0 and all(run.autograded(s.stem).exists() for s in sources):
            if not run.progress_file.exists():  # nbgrader ignores a config file it cannot load: never grade unguarded
                raise RuntimeError(f"the grading configuration was not applied (see {run.log})")
            break
        culprit, flooded = _progress(run.progress_file)
        reason = _failure_reason(proc.stdout + proc.stderr, run.cell_timeout, culprit in flooded)
        if culprit is None:
            notebook_error = f"not graded: {reason}"
            break
        exercise = _quarantine(run.submitted(), culprit, reason, course_cells)
        if exercise:
            charged.setdefault(exercise, reason)
    else:
        notebook_error = f"not graded: more than {MAX_QUARANTINES} cells had to be stopped"

    results = []
    for source in sources:
        result = NotebookResult(run.student, run.chapter, source.stem)
        autograded = run.autograded(source.stem)
        if notebook_error or not autograded.exists():
            result.error = notebook_error or "not graded: see grading.log"
            results.append(result)
            continue
        _, flooded = _progress(run.progress_file)
        for cell_id in flooded:
            exercise = _exercise_of_cell(autograded, cell_id, course_cells)
            if exercise:
                charged.setdefault(exercise, "this exercise printed more output than grading allows")
        for cell_id in _interrupted_cells(autograded):
            exercise = _exercise_of_cell(autograded, cell_id, course_cells)
            if exercise:
                charged.setdefault(exercise, f"a cell of this exercise did not finish within {run.cell_timeout} s and was interrupted")
        submitted = run.folder / "submitted" / run.student / run.chapter / source.name
        for exercise, line in reference_imports(submitted, source).items():
            charged.setdefault(exercise, f"the solution uses the course's reference code ({line}); "
                                         "solve the exercise with your own code")
        messages = _error_messages(autograded)
        order = _grade_order(source)
        rechecked = recheck(source, submitted, timeout=max(60, run.cell_timeout), sandboxed=run.sandboxed, hidden=list(run.hide))
        from nbgrader.api import Gradebook

        with Gradebook(run.gradebook_url) as gradebook:
            grades = [(g.name, float(g.score), float(g.max_score))
                      for g in gradebook.find_submission_notebook(source.stem, run.chapter, run.student).grades]
        for grade_id, score, max_score in sorted(grades, key=lambda g: order.get(g[0], len(order))):
            error = charged.get(exercise_of(grade_id), "")
            message = error or messages.get(grade_id, "")
            passed_outside, outside_message = rechecked.get(grade_id, (False, "not re-checked"))
            if score and not error and not passed_outside:
                # the kernel said yes, the clean process says no: the clean process wins
                message = f"re-checked outside your notebook: {outside_message}"
            if score and (error or not passed_outside):
                _override(run.gradebook_url, run.chapter, run.student, source.stem, grade_id, message)
                score = 0.0
            result.tests.append(TestResult(grade_id, score, max_score, message=message, error=error))
        results.append(result)
    run.nbgrader("generate_feedback", run.chapter, "--student", run.student, "--force", check=False)
    run.nbgrader("export", "--to", str(run.folder / "grades.csv"), check=False)
    return results


def _interrupted_cells(notebook_path: Path) -> list[str]:
    """Ids of the cells the grader had to interrupt (they ran past the time limit)."""
    return [cell.get("id", "") for cell in json.loads(notebook_path.read_text())["cells"]
            if any(o.get("output_type") == "error" and o.get("ename") in ("KeyboardInterrupt", "CellTimeoutError")
                   for o in cell.get("outputs", []))]


def _exercise_of_cell(notebook_path: Path, cell_id: str, course_cells: set[str]) -> str | None:
    """The exercise charged for a cell: its own grade_id; for a cell the student added, the last one above it.

    The course's own cells (explanations, training) belong to no exercise.
    """
    exercise = None
    for cell in json.loads(notebook_path.read_text())["cells"]:
        meta = _nbgrader_meta(cell)
        if meta.get("grade_id"):
            exercise = exercise_of(meta["grade_id"])
        if cell.get("id") == cell_id:
            return exercise_of(meta["grade_id"]) if meta.get("grade_id") else None if cell_id in course_cells else exercise
    return None


def grade(submissions: Path, workdir: Path, chapter_names: list[str] | None = None, cell_timeout: int = CELL_TIMEOUT,
          root: Path | None = None, jobs: int = 1, sandboxed: bool | None = None) -> list[NotebookResult]:
    """Autograde ``submissions/<student>/<chapter>/*.ipynb``; never modifies ``submissions``.

    Each student's chapter is graded by nbgrader in its own folder, ``workdir/runs/<chapter>/<student>/``
    (gradebook.db, autograded/, feedback/ HTML, grades.csv), with the kernel sandboxed when
    bubblewrap is available (``sandboxed=None`` means "if available"). ``jobs`` students are
    graded at once. Writes workdir/grades.csv (one row per student and chapter, with a status
    column), grades_by_exercise.csv and grades_by_test.csv. Returns one NotebookResult per
    student notebook.
    """
    from concurrent.futures import ThreadPoolExecutor

    from . import sandbox

    root = root or repo_root()
    submissions, workdir = Path(submissions).resolve(), Path(workdir).resolve()
    if not submissions.is_dir():
        raise ValueError(f"submissions must be a folder of <student>/<chapter>/*.ipynb, got {submissions}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if cell_timeout < 1:
        raise ValueError(f"cell_timeout must be >= 1 second, got {cell_timeout}")
    if sandboxed is None:
        sandboxed = sandbox.available()
    elif sandboxed and not sandbox.available():
        raise ValueError("sandboxed=True needs bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)")
    students = sorted(p.name for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))
    wanted = chapter_names or [c for c in chapters(root) if any((submissions / s / c).is_dir() for s in students)]
    workdir.mkdir(parents=True, exist_ok=True)
    templates = {chapter: _prepare_template(root, workdir, chapter) for chapter in wanted}
    hide = (workdir / "runs", workdir / "templates", submissions)
    tasks = [(templates[c], submissions / s / c, _Run(c, s, workdir / "runs" / c / s, cell_timeout, sandboxed, hide))
             for c in wanted for s in students if (submissions / s / c).is_dir()]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = [r for batch in pool.map(lambda task: _grade_one(*task), tasks) for r in batch]
    write_csvs(results, workdir)
    return results


def write_csvs(results: list[NotebookResult], workdir: Path) -> None:
    """grades.csv (student x chapter), grades_by_exercise.csv and grades_by_test.csv; errors are never a bare 0."""
    def rows(path, header, body):
        with Path(path).open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(header)
            writer.writerows(body)

    rows(workdir / "grades.csv", ["student", "chapter", "notebook", "score", "max_score", "status", "errors"],
         [[r.student, r.chapter, r.notebook, r.score, r.max_score, "error" if r.error or any(t.error for t in r.tests) else "graded",
           r.error or "; ".join(sorted({f"{t.exercise}: {t.error}" for t in r.tests if t.error}))] for r in results])
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


def format_report(result: NotebookResult) -> str:
    """A per-exercise report with points, and the reason each failed test gave."""
    lines = [f"{result.chapter}/{result.notebook}.ipynb ({result.student})"]
    if result.error:
        return "\n".join(lines + [f"  ERROR: {result.error}"])
    if not result.tests:
        return "\n".join(lines + ["  this chapter has no graded exercises"])
    for exercise, tests in result.exercises().items():
        score, max_score = sum(t.score for t in tests), sum(t.max_score for t in tests)
        errors = {t.error for t in tests if t.error}
        lines.append(f"  {exercise:<34} {score:g} / {max_score:g}" + (f"   ERROR: {errors.pop()}" if errors else ""))
        if any(t.error for t in tests):
            continue
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
    expected = sorted(p.name for p in (root / SOURCE_DIR / chapter).glob("*.ipynb"))
    with tempfile.TemporaryDirectory(prefix="course-check-") as tmp:
        submissions = Path(tmp) / "submitted" / "you" / chapter
        submissions.mkdir(parents=True)
        for path in notebooks:
            # nbgrader matches notebooks by name: a copy saved as "my attempt.ipynb" is graded as the chapter's notebook
            name = path.name if path.name in expected or len(expected) != 1 else expected[0]
            shutil.copy2(path, submissions / name)
        # your own notebook on your own machine: no sandbox needed
        return grade(Path(tmp) / "submitted", Path(workdir or Path(tmp) / "work"), [chapter], root=root, sandboxed=False)
