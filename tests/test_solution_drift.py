"""One source of truth: each exercise's reference solution is the course_lib function, verbatim.

The solution cell (without the nbgrader markers) must have the same syntax tree as the
function in course_lib, comments and formatting aside, so neither can change alone.
"""
from __future__ import annotations

import ast
import importlib
import inspect

import pytest

from tests.conftest import ROOT, load_notebook, nbgrader_cells, strip_solution_markers

# exercise grade_id prefix -> the course_lib function it must equal
SOLUTIONS = {
    ("01-attention/attention.ipynb", "masked_softmax"): "course_lib.attention.masked_softmax",
    ("01-attention/attention.ipynb", "additive_attention"): "course_lib.attention.additive_attention",
    ("01-attention/attention.ipynb", "scaled_dot_product_attention"): "course_lib.attention.scaled_dot_product_attention",
}


def test_every_solution_cell_is_listed():
    listed = {(nb, exercise) for nb, exercise in SOLUTIONS}
    found = set()
    for path in (ROOT / "solutions").rglob("*.ipynb"):
        for grade_id, cell in nbgrader_cells(load_notebook(path)).items():
            if cell["metadata"]["nbgrader"]["solution"]:
                found.add((str(path.relative_to(ROOT / "solutions")), grade_id.split("-", 1)[0]))
    assert found == listed


@pytest.mark.parametrize("notebook,exercise", list(SOLUTIONS))
def test_solution_cell_equals_course_lib(notebook, exercise):
    module_name, _, name = SOLUTIONS[(notebook, exercise)].rpartition(".")
    reference = inspect.getsource(getattr(importlib.import_module(module_name), name))
    cell = nbgrader_cells(load_notebook(ROOT / "solutions" / notebook))[f"{exercise}-solution"]
    solution = strip_solution_markers("".join(cell["source"]))
    assert ast.dump(ast.parse(solution)) == ast.dump(ast.parse(reference)), (
        f"the solution of {exercise} in solutions/{notebook} and {SOLUTIONS[(notebook, exercise)]} have drifted apart")
