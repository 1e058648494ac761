"""One source of truth: every function or class a solution cell defines is the course_lib one, verbatim.

For each top-level ``def``/``class`` in a solution cell (nbgrader markers removed), the
package must hold exactly one object of that name (in any ``course_lib`` module) whose
source has the same syntax tree, comments and formatting aside. Neither can change alone.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil

import pytest

import course_lib
from tests.helpers import ROOT, load_notebook, nbgrader_cells, strip_solution_markers


def course_lib_definitions() -> dict[str, list]:
    """name -> objects defined (not imported) under that name in any course_lib module, a package's modules included
    (chapter 12's exercises live in ``course_lib.serving.scheduler`` and ``course_lib.serving.model_runner``)."""
    found: dict[str, list] = {}
    for info in pkgutil.walk_packages(course_lib.__path__, "course_lib."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__:
                found.setdefault(name, []).append(obj)
    return found


def solution_cells(path):
    """(grade id, cell, names of the functions and classes it defines) of each solution cell of a notebook."""
    for grade_id, cell in nbgrader_cells(load_notebook(path)).items():
        if cell["metadata"]["nbgrader"]["solution"]:
            tree = ast.parse(strip_solution_markers("".join(cell["source"]))) if cell["cell_type"] == "code" else None
            yield grade_id, cell, [node for node in getattr(tree, "body", []) if isinstance(node, (ast.FunctionDef, ast.ClassDef))]


def solution_definitions():
    for path in sorted((ROOT / "solutions").rglob("*.ipynb")):
        for _, _, nodes in solution_cells(path):
            for node in nodes:
                yield pytest.param(node, id=f"{path.parent.name}:{node.name}")


DEFINITIONS = list(solution_definitions())


def test_every_solution_cell_of_every_chapter_is_compared():
    """Every chapter but the orientation has solution cells; each is a code cell that defines at least one function
    or class (a cell that defines none would escape the comparison below), and each of them is compared."""
    from course_lib.grading import chapters

    compared = {p.id for p in DEFINITIONS}
    without = []
    for chapter in chapters():
        (path,) = (ROOT / "solutions" / chapter).glob("*.ipynb")
        cells = list(solution_cells(path))
        if not cells:
            without.append(chapter)
        for grade_id, cell, nodes in cells:
            assert cell["cell_type"] == "code" and nodes, f"{chapter} {grade_id}: defines no function or class"
            assert {f"{chapter}:{node.name}" for node in nodes} <= compared, (chapter, grade_id)
    assert without == ["00-orientation"]
    assert len(compared) == len(DEFINITIONS)  # one test per definition: no two share a chapter and a name


@pytest.mark.parametrize("node", DEFINITIONS)
def test_solution_equals_its_course_lib_twin(node):
    twins = course_lib_definitions().get(node.name, [])
    assert len(twins) == 1, f"{node.name}: expected exactly one course_lib definition, found {len(twins)}"
    reference = ast.parse(inspect.getsource(twins[0])).body[0]
    assert ast.dump(node) == ast.dump(reference), (
        f"the solution of {node.name} and {twins[0].__module__}.{node.name} have drifted apart")
