"""The course on disk and nbgrader's settings for it: chapters, release, re-execution.

Layout (nbgrader's names in brackets)::

    solutions/NN-name/*.ipynb   reference notebooks [source]
    notebooks/NN-name/*.ipynb   student release     [release]

``release`` regenerates notebooks/ in place with nbgrader; ``configure`` holds the settings that
nbgrader_config.py, ``course release`` and ``course grade`` share.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

COURSE_ID = "attention-to-decoding"
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
#: seconds one test may run while grading before it is stopped and scored as an error
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


def configure_course_folder(c) -> None:
    """nbgrader's settings for an instructor's own course folder on a hub (docs/hub/instructor_nbgrader_config.py):
    the course's settings, releasing the installed course's notebooks/ by absolute path, so that
    ``nbgrader release_assignment NN-name`` and ``course collect-and-grade NN`` work from that folder."""
    configure(c)
    c.CourseDirectory.source_directory = str(repo_root() / SOURCE_DIR)
    c.CourseDirectory.release_directory = str(repo_root() / RELEASE_DIR)


def repo_root() -> Path:
    """The course repository this package was installed from (it holds solutions/)."""
    root = Path(__file__).resolve().parents[2]
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


def config_text(cell_timeout: int) -> str:
    return ("from course_lib.grading import configure\n"
            f"configure(get_config(), cell_timeout={cell_timeout})  # noqa: F821\n")


def run_nbgrader(args: list[str], cwd: Path, log: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``nbgrader ARGS`` in ``cwd`` with this interpreter; with ``check``, raise with the log tail on failure."""
    return _run_python(["-m", "nbgrader", *args], f"nbgrader {' '.join(args)}", cwd, log, check)


def _run_python(argv: list[str], what: str, cwd: Path, log: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``python ARGV`` (this interpreter) in ``cwd``, logged as ``what``; with ``check``, raise with the log tail on failure."""
    # nbgrader runs helper executables (alembic) by name: put this interpreter's bin/ first on PATH
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    proc = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, env=env)
    if log is not None:
        with log.open("a") as fh:
            fh.write(f"$ {what}\n{proc.stdout}{proc.stderr}\n")
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc


#: ``nbgrader generate_assignment NAME --force --no-db`` for each NAME, in one process (importing nbgrader takes
#: seconds: once, not once per chapter); an nbgrader error exits with status 1, as the command does.
_GENERATE_ASSIGNMENTS = """
import sys
from nbgrader.apps.generateassignmentapp import GenerateAssignmentApp
root, names = sys.argv[1], sys.argv[2:]
for name in names:
    app = GenerateAssignmentApp()
    app.initialize([name, "--force", "--no-db", f"--CourseDirectory.root={root}"])
    app.start()
"""


def release(chapter_names: list[str] | None = None, root: Path | None = None) -> list[Path]:
    """Regenerate ``notebooks/<chapter>/`` from ``solutions/<chapter>/`` with nbgrader; returns the folders."""
    root = root or repo_root()
    names = chapter_names or chapters(root)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "nbgrader_config.py"
        config.write_text(config_text(CELL_TIMEOUT))
        # nbgrader reads nbgrader_config.py from its working directory
        _run_python(["-c", _GENERATE_ASSIGNMENTS, str(root), *names], f"nbgrader generate_assignment {' '.join(names)}", Path(tmp))
    return [root / RELEASE_DIR / name for name in names]


#: load per core (the 1-minute load average over the cores this process may use) from which `course execute` calls the
#: machine busy: half the cores already taken by other work. Timings stored then contradict their prose (a second
#: thread that buys nothing, a step that slows with no kernel changed).
BUSY_LOAD_PER_CORE = 0.5


def timed_chapters(root: Path | None = None) -> list[str]:
    """The chapters whose stored outputs hold timings: the folders of the Makefile's TIMED list (the one list: ``make
    busy`` re-executes them on a busy machine), e.g. ['05-kv-cache', '07-speculative', ...]."""
    makefile = (root or repo_root()) / "Makefile"
    text = makefile.read_text().replace("\\\n", " ")
    match = re.search(r"^TIMED\s*[:?]?=(.*)$", text, flags=re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{makefile} has no TIMED = ... line: the timed chapters are listed there")
    return [Path(folder).name for folder in match.group(1).split()]


def load_per_core() -> tuple[float, int]:
    """(load, cores): the 1-minute load average divided by the cores this process may run on (1.0: every core has a
    runnable process on average), and that number of cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return os.getloadavg()[0] / cores, cores


def refused_when_busy(chapter_names: list[str], load: float, busy_ok: bool = False, root: Path | None = None) -> list[str]:
    """The timed chapters among `chapter_names` that `course execute` must not re-execute at this load per core:
    all of them when load >= BUSY_LOAD_PER_CORE, unless `busy_ok`; none otherwise."""
    if busy_ok or load < BUSY_LOAD_PER_CORE:
        return []
    timed = set(timed_chapters(root))
    return [name for name in chapter_names if name in timed]


def execute_solutions(chapter_names: list[str] | None = None, root: Path | None = None, timeout: int = 600) -> list[Path]:
    """Re-execute reference notebooks in place so their stored outputs are current (for nbval).

    No per-cell timing metadata is stored: it would change on every run and leak into the release.
    """
    import nbformat
    from nbclient import NotebookClient

    root = root or repo_root()
    done = []
    for name in chapters(root) if chapter_names is None else chapter_names:
        for path in sorted((root / SOURCE_DIR / name).glob("*.ipynb")):
            notebook = nbformat.read(path, as_version=4)
            NotebookClient(notebook, timeout=timeout, kernel_name="python3", record_timing=False,
                           resources={"metadata": {"path": str(path.parent)}}).execute()
            for cell in notebook.cells:
                cell.metadata.pop("execution", None)
            nbformat.write(notebook, path)
            done.append(path)
    return done
