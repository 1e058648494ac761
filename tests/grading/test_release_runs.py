"""A released notebook runs top to bottom with nothing filled in: only its graded test cells stop.

Before a learner writes anything, every demonstration must run on the course's versions (``course_lib.yours``
says so in one line) and only the cells that test an exercise fail, with the exercise's NotImplementedError.
The static reading of every chapter is tests/grading/test_yours_everywhere.py; this runs the released notebooks of
the chapters that execute in seconds (04, 07 and 08 time decoding and take about a minute each).
"""
from __future__ import annotations

import shutil

import nbclient
import nbformat
import pytest

from tests.helpers import ROOT

SKIPPED = {"00-orientation", "04-gpt", "07-speculative", "08-memory-bound"}
CHAPTERS = sorted(p.name for p in (ROOT / "notebooks").iterdir() if p.is_dir() and p.name not in SKIPPED)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_release_runs_with_nothing_filled_in_and_only_graded_cells_fail(chapter, tmp_path, monkeypatch):
    # the kernel times each alternating measurement in 2 rounds, as the run as on another CPU does (conftest.py): here
    # too its timings are read only by claims with wide margins
    monkeypatch.setenv("COURSE_TIMING_ROUNDS", "2")
    folder = tmp_path / chapter
    shutil.copytree(ROOT / "notebooks" / chapter, folder)
    for path in sorted(folder.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        nbclient.NotebookClient(notebook, allow_errors=True, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(folder)}}).execute()
        errors = {index: (cell.metadata.get("nbgrader", {}), output) for index, cell in enumerate(notebook.cells)
                  for output in cell.get("outputs", []) if output.get("output_type") == "error"}
        outside = [f"cell {index}: {output['ename']}: {output['evalue'][:200]}"
                   for index, (meta, output) in errors.items() if not meta.get("grade")]
        assert not outside, f"{path.name}: cells other than graded tests failed with nothing filled in: {outside}"
        assert errors, f"{path.name}: no graded test failed, yet nothing was filled in"
        not_implemented = [index for index, (_, output) in errors.items() if "NotImplementedError" in
                           output["ename"] + output["evalue"] + "".join(output.get("traceback", []))]
        assert not_implemented, f"{path.name}: the graded cells failed, but none with the exercise's NotImplementedError"
        fallbacks = "".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
        assert "the course's version runs below" in fallbacks, f"{path.name}: no demonstration said it ran the course's version"
