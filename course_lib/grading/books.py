"""nbgrader's books: the gradebook, the autograded notebook and the feedback, kept by nbgrader itself.

The clean room decides each test; nbgrader records it. ``autograde`` runs nbgrader's own
``Autograde`` converter in this process (nbgrader's API, no kernel), with its ``Execute``
preprocessor replaced by ``InjectVerdicts``: every test cell gets the clean room's verdict as
its output (an error output when it failed), and nbgrader's ``SaveAutoGrades`` scores it as
usual. nbgrader's own sanitizing still runs first: test cells are restored from the gradebook,
points and metadata come from it, never from the submission. ``feedback`` is nbgrader's
``generate_feedback``. Each student's chapter has a course folder of its own, copied from a
template (``prepare_template``) whose gradebook already knows the chapter's cells.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

from .course import SOURCE_DIR, configure

# nbgrader's apps share loggers and os.environ: one at a time in this process
_LOCK = threading.Lock()
#: what recording in the books imports (nbgrader's apps take seconds to import): a process that will, may import them first
NBGRADER_MODULES = ("nbgrader.apps", "nbgrader.api", "nbgrader.converters", "nbgrader.preprocessors", "alembic.script")


def _alembic_head() -> str:
    """The schema revision of nbgrader's gradebook: the head of nbgrader's own alembic scripts, read in this process.
    It is what nbgrader asks the ``alembic heads`` command for when it creates a gradebook (a Python process of
    its own: about 2.5 s of CPU for each chapter's template)."""
    from alembic.script import ScriptDirectory
    from nbgrader.dbutil import ALEMBIC_DIR

    return ScriptDirectory(ALEMBIC_DIR).get_current_head()


@contextlib.contextmanager
def _nbgrader_at_work():
    """One nbgrader app at a time; the SQLAlchemy warnings its gradebook code raises in-process are not ours; a new
    gradebook learns its schema revision from ``_alembic_head`` instead of a process of the ``alembic`` command."""
    import nbgrader.api
    from sqlalchemy.exc import SAWarning

    with _LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", SAWarning)
        asked = nbgrader.api.get_alembic_version
        nbgrader.api.get_alembic_version = _alembic_head
        try:
            yield
        finally:
            nbgrader.api.get_alembic_version = asked


@contextlib.contextmanager
def _commits_unsynced():
    """SQLite connections opened meanwhile commit without waiting for the disk (``PRAGMA synchronous=OFF``): recording
    one notebook commits about 50 times, and on a busy disk those waits were most of its time (0.3-0.5 s per notebook,
    measured). For a student's books only: they are rebuilt from the template at every grading and written as the CSVs
    and the feedback beside them are (a crash midway means a rerun). Never for a template: the cache keeps those."""
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    def unsynced(connection, _record) -> None:
        if isinstance(connection, sqlite3.Connection):
            connection.execute("PRAGMA synchronous=OFF")

    event.listen(Engine, "connect", unsynced)
    try:
        yield
    finally:
        event.remove(Engine, "connect", unsynced)


def _inject_verdicts_class():
    from nbformat.v4 import new_markdown_cell, new_output
    from nbgrader.preprocessors import NbGraderPreprocessor
    from traitlets import Dict, List

    class InjectVerdicts(NbGraderPreprocessor):
        """Put the clean room's verdicts into the test cells (instead of executing the notebook)."""

        verdicts = Dict(help="grade_id -> '' (passed) or why the test failed").tag(config=True)
        notes = List(help="what grading ignored or repaired, shown at the top of the feedback").tag(config=True)

        def preprocess(self, nb, resources):
            for cell in nb.cells:
                meta = cell.metadata.get("nbgrader", {})
                if cell.cell_type != "code" or not meta.get("grade"):
                    continue
                message = self.verdicts.get(meta.get("grade_id"), "not graded")
                cell.outputs = [] if message == "" else [
                    new_output("error", ename="TestFailed", evalue=message, traceback=[f"TestFailed: {message}"])]
            if self.notes:
                text = "**Grading notes** (nothing here cost points)\n\n" + "\n".join(f"- {note}" for note in self.notes)
                nb.cells.insert(0, new_markdown_cell(text))
            return nb, resources

    return InjectVerdicts


def _config(folder: Path, verdicts: dict | None = None, notes: list[str] = ()):
    from nbgrader.converters import Autograde
    from nbgrader.preprocessors import Execute
    from traitlets.config import Config

    c = Config()
    configure(c)
    c.CourseDirectory.root = str(folder)
    c.CourseDirectory.db_url = f"sqlite:///{folder / 'gradebook.db'}"
    if verdicts is not None:
        inject = _inject_verdicts_class()
        default = Autograde.class_traits()["autograde_preprocessors"].default()
        c.Autograde.autograde_preprocessors = [inject if p is Execute else p for p in default]
        c.InjectVerdicts.verdicts = verdicts
        c.InjectVerdicts.notes = list(notes)
    return c


def _api(config):
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    return NbGraderAPI(CourseDirectory(config=config), config=config)


def _checked(result: dict, what: str) -> None:
    if not result.get("success"):
        tail = "\n".join(((result.get("log") or "") + (result.get("error") or "")).splitlines()[-40:])
        raise RuntimeError(f"nbgrader {what} failed:\n{tail}")


def _template_key(root: Path, chapter: str) -> str:
    """What a chapter's template depends on: its source notebooks, nbgrader's version and the course's settings
    (every value ``configure`` sets, its stubs included)."""
    import hashlib

    import nbgrader
    from traitlets.config import Config

    settings = Config()
    configure(settings)
    digest = hashlib.sha256(f"{nbgrader.__version__}\n{json.dumps(settings, sort_keys=True, default=repr)}".encode())
    for path in sorted((root / SOURCE_DIR / chapter).rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


def template_cache() -> Path:
    """Where built templates are kept between grading runs (a chapter's is rebuilt when its source changes)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "attention-to-decoding" / "grading-templates"


def _build_template(root: Path, chapter: str, folder: Path) -> None:
    folder.mkdir(parents=True)
    shutil.copytree(root / SOURCE_DIR / chapter, folder / SOURCE_DIR / chapter)
    with _nbgrader_at_work():
        _checked(_api(_config(folder)).generate_assignment(chapter, force=True, create=True), "generate_assignment")
    shutil.rmtree(folder / "release", ignore_errors=True)


def prepare_template(root: Path, workdir: Path, chapter: str) -> Path:
    """``workdir/templates/<chapter>``: a course folder with the chapter's source and a gradebook that knows
    its cells. Building one takes nbgrader seconds, so it is built once per source and kept in
    ``template_cache()``; where the cache cannot be written, it is built in place."""
    template = workdir / "templates" / chapter
    shutil.rmtree(template, ignore_errors=True)
    cached = template_cache() / f"{chapter}-{_template_key(root, chapter)}"
    if (cached / "gradebook.db").is_file():
        shutil.copytree(cached, template)
        return template
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f".{chapter}-", dir=cached.parent))
    except OSError:
        _build_template(root, chapter, template)
        return template
    try:
        _build_template(root, chapter, building / "t")
        try:
            (building / "t").rename(cached)  # atomic: a grader building the same one at once loses the race
        except OSError:
            pass
        shutil.copytree(cached if (cached / "gradebook.db").is_file() else building / "t", template)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return template


def autograde(folder: Path, chapter: str, student: str, notebooks: dict[str, dict],
              verdicts: dict[str, str], notes: list[str], feedback: bool = True) -> dict[str, dict[str, float]]:
    """Record one student's chapter in nbgrader's books in ``folder``, and write its feedback (unless not ``feedback``).

    notebooks: notebook name -> the submission as nbgrader gets it; verdicts: grade_id -> ''
    (passed) or why it failed; notes: what grading ignored or repaired.
    Returns notebook name -> grade_id -> score, read back from nbgrader's gradebook.
    """
    from nbgrader.api import Gradebook

    submitted = folder / "submitted" / student / chapter
    submitted.mkdir(parents=True, exist_ok=True)
    for name, notebook in notebooks.items():
        (submitted / f"{name}.ipynb").write_text(json.dumps(notebook, indent=1))
    with _nbgrader_at_work(), _commits_unsynced():
        _checked(_api(_config(folder, verdicts, notes)).autograde(chapter, student, force=True, create=True), "autograde")
        if feedback:
            _checked(_api(_config(folder)).generate_feedback(chapter, student, force=True), "generate_feedback")
        with Gradebook(f"sqlite:///{folder / 'gradebook.db'}") as gradebook:
            return {name: {g.name: float(g.score) for g in gradebook.find_submission_notebook(name, chapter, student).grades}
                    for name in notebooks}
