"""notebooks/ is exactly what `course release` makes from solutions/, and leaks nothing."""
from __future__ import annotations

import shutil

import pytest

from course_lib import grading
from tests.helpers import ROOT, load_notebook, nbgrader_cells, strip_solution_markers

CHAPTERS = grading.chapters(ROOT)


def test_there_is_a_release_for_every_chapter_and_no_other():
    assert sorted(p.name for p in (ROOT / "notebooks").iterdir() if p.is_dir()) == CHAPTERS


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and ".ipynb_checkpoints" not in p.parts}


def test_committed_release_equals_a_fresh_release(tmp_path):
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    grading.release(root=tmp_path)
    fresh, committed = _files(tmp_path / "notebooks"), _files(ROOT / "notebooks")
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, f"notebooks/ is stale, run `course release`: {stale}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_release_contains_no_hidden_tests_no_solutions_and_no_outputs(chapter):
    for source_path in (ROOT / "solutions" / chapter).glob("*.ipynb"):
        source = load_notebook(source_path)
        released_path = ROOT / "notebooks" / chapter / source_path.name
        released_text = released_path.read_text()
        assert "BEGIN HIDDEN TESTS" not in released_text and "BEGIN SOLUTION" not in released_text
        released = load_notebook(released_path)
        assert all(not c.get("outputs") for c in released["cells"] if c["cell_type"] == "code")
        assert "widgets" not in released["metadata"], f"{released_path.name} carries the solution's widget state"
        released_cells = nbgrader_cells(released)
        for grade_id, cell in nbgrader_cells(source).items():
            text = "".join(cell["source"])
            if "### BEGIN HIDDEN TESTS" in text:
                hidden = text.split("### BEGIN HIDDEN TESTS")[1].split("### END HIDDEN TESTS")[0]
                for line in filter(None, (l.strip() for l in hidden.splitlines())):
                    assert line not in "".join(released_cells[grade_id]["source"]), f"{grade_id} leaks: {line}"
            if cell["metadata"]["nbgrader"]["solution"]:
                body = text.split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0]
                for line in filter(None, (l.strip() for l in body.splitlines())):
                    if not line.startswith("#"):
                        assert line not in released_text, f"{grade_id} leaks solution line: {line}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_source_notebooks_have_outputs_and_consistent_nbgrader_metadata(chapter):
    for path in (ROOT / "solutions" / chapter).glob("*.ipynb"):
        notebook = load_notebook(path)
        code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
        assert all(c.get("execution_count") for c in code), f"{path.name}: run `course execute` so stored outputs are current"
        assert not any("execution" in c.get("metadata", {}) for c in notebook["cells"]), (
            f"{path.name} stores per-cell timings (they leak into the release): run `course execute`")
        for grade_id, cell in nbgrader_cells(notebook).items():
            meta = cell["metadata"]["nbgrader"]
            exercise = grade_id.split("-", 1)[0]
            if meta["grade"]:
                assert meta["locked"] and meta["points"] > 0 and not meta["solution"]
                assert f"{exercise}-solution" in nbgrader_cells(notebook), f"test {grade_id} has no exercise {exercise}"
            else:
                assert meta["solution"] and grade_id == f"{exercise}-solution"
                assert strip_solution_markers("".join(cell["source"])) != "".join(cell["source"])


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_nbval_markers_are_ones_nbval_honours(chapter):
    """nbval reads a marker only when the comment line is exactly the marker: `# NBVAL_IGNORE_OUTPUT  (why)`
    is silently ignored, and the cell's output is then compared after all."""
    from nbval.plugin import comment_markers

    for path in (ROOT / "solutions" / chapter).glob("*.ipynb"):
        for cell in load_notebook(path)["cells"]:
            for line in "".join(cell["source"]).splitlines():
                comment = line.strip().lstrip("#").strip()
                if line.strip().startswith("#") and comment.startswith("NBVAL"):
                    assert comment in comment_markers, f"{path.name}: {line.strip()!r} is not a marker nbval reads"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_visible_test_of_the_release_lets_run_all_go_on(chapter):
    """Each released visible test cell (grade id ``<exercise>-visible``) carries JupyterLab's ``raises-exception`` tag,
    so that Run All goes past an unfinished exercise's failed check; no other cell carries it (a demonstration that
    raises must still stop Run All)."""
    for path in (ROOT / "notebooks" / chapter).glob("*.ipynb"):
        for cell in load_notebook(path)["cells"]:
            grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id", "")
            tagged = "raises-exception" in cell["metadata"].get("tags", [])
            assert tagged == grade_id.endswith("-visible"), (
                f"{path.name} {grade_id or cell.get('id')}: " + ("tagged raises-exception, yet not a visible test"
                                                                 if tagged else "a visible test without the tag"))


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_no_solution_carries_the_tag_nbval_would_read_as_an_excuse(chapter):
    """nbval honours ``raises-exception`` (it does not require an error, it allows one): in solutions/, a reference
    solution failing its own visible check would no longer fail nbval by itself, only by a differing output, and not at
    all where outputs are not compared (NBVAL_IGNORE_OUTPUT, --nbval-lax) or the stored output is the error. The tag
    is added by `course release`, to the release only."""
    from nbval.plugin import metadata_tags

    assert metadata_tags["raises-exception"] == "check_exception"  # what nbval does with it
    for path in (ROOT / "solutions" / chapter).glob("*.ipynb"):
        tagged = [cell.get("id") for cell in load_notebook(path)["cells"] if "raises-exception" in cell["metadata"].get("tags", [])]
        assert not tagged, f"{path.name}: cells {tagged} carry raises-exception"
