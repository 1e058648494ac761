"""nbgrader's templates are built once per chapter source and kept: a changed source gets a new one."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from course_lib.grading import books
from tests.helpers import ROOT


@pytest.fixture
def built(tmp_path, monkeypatch):
    """The chapters whose template was built, in order, with a cache of the test's own and chapter 00 copied to
    ``tmp_path / "course"``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    chapters = []
    build = books._build_template
    monkeypatch.setattr(books, "_build_template", lambda *args: chapters.append(args[1]) or build(*args))
    shutil.copytree(ROOT / "solutions" / "00-orientation", tmp_path / "course" / "solutions" / "00-orientation")
    return chapters


def test_a_template_is_built_once_per_source_and_rebuilt_when_the_source_changes(tmp_path, built):
    root = tmp_path / "course"
    first = books.prepare_template(root, tmp_path / "run1", "00-orientation")
    again = books.prepare_template(root, tmp_path / "run2", "00-orientation")
    assert built == ["00-orientation"], "the second grading run reuses the first one's template"
    assert (first / "gradebook.db").is_file() and (again / "gradebook.db").is_file()
    assert (again / "solutions" / "00-orientation" / "orientation.ipynb").read_bytes() == \
        (ROOT / "solutions" / "00-orientation" / "orientation.ipynb").read_bytes()

    notebook = root / "solutions" / "00-orientation" / "orientation.ipynb"
    changed = json.loads(notebook.read_text())
    changed["cells"][0]["source"] = "# a new title\n"
    notebook.write_text(json.dumps(changed))
    rebuilt = books.prepare_template(root, tmp_path / "run3", "00-orientation")
    assert built == ["00-orientation", "00-orientation"], "a changed source gets a template of its own"
    assert json.loads((rebuilt / "solutions" / "00-orientation" / "orientation.ipynb").read_text()) == changed
    assert len(list((tmp_path / "cache" / "attention-to-decoding" / "grading-templates").iterdir())) == 2


def test_a_changed_course_setting_gets_a_new_template(tmp_path, monkeypatch, built):
    """The template's gradebook is nbgrader's reading of the source under the course's settings (its stubs among
    them): a template kept from other settings must not be reused."""
    from course_lib.grading import course

    root = tmp_path / "course"
    books.prepare_template(root, tmp_path / "run1", "00-orientation")
    monkeypatch.setattr(course, "CODE_STUB", "# YOUR CODE HERE\nraise NotImplementedError('write it')")
    books.prepare_template(root, tmp_path / "run2", "00-orientation")
    assert built == ["00-orientation", "00-orientation"], "a template built under the old code stub was reused"


def test_a_template_gradebook_is_at_the_schema_revision_nbgrader_itself_reports(tmp_path, monkeypatch, built):
    """The revision is read in-process (books._alembic_head); nbgrader's own way asks the ``alembic`` command."""
    import sqlite3
    import sys

    import nbgrader.api

    template = books.prepare_template(tmp_path / "course", tmp_path / "run1", "00-orientation")
    with sqlite3.connect(template / "gradebook.db") as db:
        (recorded,), = db.execute("SELECT version_num FROM alembic_version").fetchall()
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # its `alembic`
    assert recorded == nbgrader.api.get_alembic_version()
