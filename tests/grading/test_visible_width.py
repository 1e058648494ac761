"""What a learner reads of a graded test cell fits the notebook's width: no line past ``WIDTH`` characters.

A graded test cell's lines outside its ``### BEGIN/END HIDDEN TESTS`` block are in the release: the visible test,
and the comment that says what a hidden test checks. In JupyterLab at 1440 pixels with the file browser open, a
code line shows about 110 characters; a longer one runs off the right edge (the cell scrolls sideways, the end of
the sentence hidden). 100 leaves a margin.
"""
from __future__ import annotations

import pytest

from course_lib import grading
from tests.helpers import ROOT, load_notebook, nbgrader_cells

WIDTH = 100
CHAPTERS = grading.chapters(ROOT)


def released_lines(source: str) -> list[str]:
    lines, hidden = [], False
    for line in source.splitlines():
        hidden |= line.strip() == "### BEGIN HIDDEN TESTS"
        if not hidden:
            lines.append(line)
        hidden &= line.strip() != "### END HIDDEN TESTS"
    return lines


def test_the_hidden_block_is_left_out():
    source = "# what it checks\n### BEGIN HIDDEN TESTS\nx = 1\n### END HIDDEN TESTS\n# after"
    assert released_lines(source) == ["# what it checks", "# after"]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_graded_test_cells_fit_the_width(chapter):
    long = []
    for path in (ROOT / "solutions" / chapter).glob("*.ipynb"):
        for grade_id, cell in nbgrader_cells(load_notebook(path)).items():
            if cell["metadata"]["nbgrader"]["grade"]:
                long += [f"{grade_id}: {len(line)} characters: {line[:50]}..."
                         for line in released_lines("".join(cell["source"])) if len(line) > WIDTH]
    assert not long, f"lines past {WIDTH} characters (rewrap them):\n" + "\n".join(long)
