"""Every chapter runs on the learner's functions once they pass, and the release runs with nothing filled in.

After an exercise, a demonstration that calls the exercise's function or class goes through
``course_lib.yours.yours`` (the learner's version once it passes its visible check, the course's until then).
This is read from the reference notebooks' code, statically: in every code cell that is neither an answer cell
nor a graded test cell, a name the chapter's answer cells define may be used only

- as an argument of ``yours(...)``, or
- after a cell rebound it with ``name = yours(name, ...)``.

A direct use would stop the learner's release notebook with NotImplementedError before they filled it in, or
silently run an unchecked function. So would reaching past the exercise to the course's own version
(``course_lib.module.name`` or ``from course_lib.module import name``) outside ``yours(...)``; that is flagged too.
"""
from __future__ import annotations

import ast
import textwrap

import pytest

from course_lib import grading
from tests.helpers import ROOT, load_notebook

CHAPTERS = grading.chapters(ROOT)


def _code(cell: dict) -> str:
    """A cell's source as Python: IPython magics and shell lines become comments."""
    lines = "".join(cell["source"]).splitlines()
    return textwrap.dedent("\n".join("#" + line if line.lstrip().startswith(("%", "!")) else line for line in lines))


def _nbgrader(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _exercise_names(notebook: dict) -> set[str]:
    """Top-level functions and classes the answer cells define."""
    names = set()
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code" and _nbgrader(cell).get("solution"):
            names |= {node.name for node in ast.parse(_code(cell)).body
                      if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    return names


def _is_yours_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "yours"


class _Uses(ast.NodeVisitor):
    """Loads of exercise names (and reaches for the course's versions) outside yours(...)."""

    def __init__(self, names: set[str], course_aliases: set[str], course_modules: set[str]):
        self.names, self.course_aliases, self.course_modules = names, course_aliases, course_modules
        self.found: list[str] = []

    def visit_Call(self, node: ast.Call) -> None:
        if not _is_yours_call(node):
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and (node.id in self.names or node.id in self.course_aliases):
            self.found.append(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in self.names and _root(node.value) in self.course_modules:
            self.found.append(ast.unparse(node))
        self.generic_visit(node)


def _root(node: ast.AST) -> str | None:
    """The leftmost name of ``a.b.c``."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _course_modules(tree: ast.Module) -> set[str]:
    """Local names of course_lib and of its modules (``import course_lib.x``, ``from course_lib import x``)."""
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                        if alias.name.split(".")[0] == "course_lib"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib"):
            modules |= {alias.asname or alias.name for alias in node.names}
    return modules


def _rebound_by_yours(tree: ast.Module) -> set[str]:
    """Names a top-level ``name = yours(name, ...)`` rebinds."""
    return {target.id for node in tree.body if isinstance(node, ast.Assign) and _is_yours_call(node.value)
            for target in node.targets if isinstance(target, ast.Name)
            and node.value.args and getattr(node.value.args[0], "id", None) == target.id}


def _course_aliases(tree: ast.Module, names: set[str]) -> set[str]:
    """Local names bound by ``from course_lib... import name [as alias]`` for an exercise's name."""
    return {alias.asname or alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib")
            for alias in node.names if alias.name in names}


def direct_uses(notebook: dict) -> list[str]:
    """'cell N: name' for every use of an exercise's name that does not go through yours(...)."""
    names = _exercise_names(notebook)
    safe: set[str] = set()
    course_aliases: set[str] = set()
    course_modules: set[str] = {"course_lib"}
    problems = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        tree = ast.parse(_code(cell))
        meta = _nbgrader(cell)
        course_aliases |= _course_aliases(tree, names)
        course_modules |= _course_modules(tree)
        if meta.get("solution") or meta.get("grade"):
            continue  # the learner's own code, and the graded checks of it
        found = []
        for statement in tree.body:  # in order: a rebinding covers the statements after it, in its cell too
            uses = _Uses(names - safe, course_aliases, course_modules)
            uses.visit(statement)
            found += uses.found
            safe |= _rebound_by_yours(ast.Module(body=[statement], type_ignores=[]))
        problems += [f"cell {index}: {name}" for name in dict.fromkeys(found)]
    return problems


@pytest.mark.parametrize("chapter", [c for c in CHAPTERS if c != "00-orientation"])
def test_demonstrations_run_the_learners_functions_through_yours(chapter):
    for path in sorted((ROOT / "solutions" / chapter).glob("*.ipynb")):
        problems = direct_uses(load_notebook(path))
        assert not problems, (f"{path.name}: these cells use an exercise's function directly; rebind it first with "
                              f"`name = yours(name, checks.check_name, course_lib.module.name)`: {problems}")


def _notebook(*cells: tuple[str, dict]) -> dict:
    return {"cells": [{"cell_type": "code", "source": source, "metadata": {"nbgrader": meta} if meta else {}}
                      for source, meta in cells]}


ANSWER = {"solution": True, "grade": False, "grade_id": "f-solution"}
GRADED = {"solution": False, "grade": True, "grade_id": "f-visible"}


def test_the_static_reading_flags_what_it_should_and_nothing_else():
    answer = ("def f(x):\n    raise NotImplementedError()", ANSWER)
    check = ("checks.check_f(f)", GRADED)
    assert direct_uses(_notebook(answer, check, ("y = f(1)", {}))) == ["cell 2: f"]
    assert direct_uses(_notebook(answer, check, ("f = yours(f, checks.check_f, course_lib.m.f)", {}),
                                 ("y = f(1)", {}))) == []
    assert direct_uses(_notebook(answer, ("g = yours(f, checks.check_f, course_lib.m.f)\ny = g(1)", {}))) == []
    # reaching past the exercise to the course's version is flagged, by attribute or by import
    assert direct_uses(_notebook(answer, ("y = course_lib.m.f(1)", {}))) == ["cell 1: course_lib.m.f"]
    assert direct_uses(_notebook(("from course_lib import m", {}), answer, ("y = m.f(1)", {}))) == ["cell 2: m.f"]
    assert direct_uses(_notebook(("import numpy as np", {}), answer, ("y = np.f(1)", {}))) == []
    assert direct_uses(_notebook(("from course_lib.m import f as reference_f", {}), answer,
                                 ("y = reference_f(1)", {}))) == ["cell 2: reference_f"]
    # a rebinding covers what follows it in its own cell, not what comes before it
    assert direct_uses(_notebook(answer, ("f = yours(f, checks.check_f, course_lib.m.f)\ny = f(1)", {}))) == []
    assert direct_uses(_notebook(answer, ("y = f(1)\nf = yours(f, checks.check_f, course_lib.m.f)", {}))) == ["cell 1: f"]
    # rebinding to another name does not make the original name safe
    assert direct_uses(_notebook(answer, ("g = yours(f, c, r)", {}), ("f(2)", {}))) == ["cell 2: f"]
    # uses inside a later answer cell (the learner's code) are the learner's business
    assert direct_uses(_notebook(answer, ("def g():\n    return f(1)", ANSWER))) == []
