"""Every chapter's visible checks, from one table read off the notebooks themselves.

Each visible test cell (grade id ``<exercise>-visible``) calls ``checks.check_<name>(<the learner's names>)``.
For each such cell, in every chapter: the course_lib reference of each name passes the check (it prints
"all visible checks passed"), and the released notebook's unfinished answer cell (nothing filled in) makes
the check raise the exercise's own NotImplementedError, not a check failure or a hint about shapes: a
``NotWrittenYet`` (a NotImplementedError) saying which of the learner's names is not written yet.
A chapter's own test file (tests/chapters/chNN/test_checks_NN.py) holds what differs: its planted bugs and correct alternatives.
"""
from __future__ import annotations

import ast
import re
import importlib
import inspect
import pkgutil
from dataclasses import dataclass

import pytest
import torch

import course_lib
from course_lib import checks
from tests.helpers import ROOT, load_notebook, nbgrader_cells


@dataclass(frozen=True)
class VisibleCheck:
    chapter: str  # "04-gpt"
    exercise: str  # "gpt"
    check: str  # "check_gpt"
    names: tuple  # the learner's names it is called with: ("GPT",)

    def __str__(self):
        return f"{self.chapter}:{self.exercise}"


def visible_checks() -> list[VisibleCheck]:
    found = []
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        for grade_id, cell in nbgrader_cells(load_notebook(path)).items():
            if not grade_id.endswith("-visible"):
                continue
            calls = [node for node in ast.walk(ast.parse("".join(cell["source"]))) if isinstance(node, ast.Call)
                     and isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", None) == "checks"]
            assert len(calls) == 1, f"{path.name} {grade_id}: expected one checks.check_...() call"
            found.append(VisibleCheck(path.parent.name, grade_id.removesuffix("-visible"), calls[0].func.attr,
                                      tuple(arg.id for arg in calls[0].args)))
    return found


def reference(name: str):
    """The one course_lib function or class of that name (tests/grading/test_solution_drift.py keeps it equal to the solution)."""
    twins = []
    for info in pkgutil.walk_packages(course_lib.__path__, "course_lib."):  # packages too (course_lib.serving)
        obj = vars(importlib.import_module(info.name)).get(name)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == info.name:
            twins.append(obj)
    assert len(twins) == 1, f"{name}: expected exactly one course_lib definition, found {len(twins)}"
    return twins[0]


def unfinished(chapter: str, exercise: str, name: str):
    """``name`` as the released notebook defines it before the learner writes anything."""
    release = next((ROOT / "notebooks" / chapter).glob("*.ipynb"))
    source = "".join(nbgrader_cells(load_notebook(release))[f"{exercise}-solution"]["source"])
    namespace = dict(vars(inspect.getmodule(reference(name))))  # the imports the reference module has
    exec(compile(source, f"{chapter} {exercise}-solution", "exec"), namespace)  # noqa: S102 - the course's own release
    return namespace[name]


CHECKS = visible_checks()


def test_the_table_holds_every_exercise_of_every_chapter():
    """One visible check per exercise (grade id ``<exercise>-solution``) of every notebook, and no other."""
    exercises = {(path.parent.name, grade_id.removesuffix("-solution"))
                 for path in sorted((ROOT / "solutions").glob("*/*.ipynb"))
                 for grade_id in nbgrader_cells(load_notebook(path)) if grade_id.endswith("-solution")}
    assert sorted((c.chapter, c.exercise) for c in CHECKS) == sorted(exercises)
    assert {c.chapter for c in CHECKS} == {p.parent.name for p in (ROOT / "solutions").glob("*/*.ipynb")} - {"00-orientation"}


@pytest.mark.parametrize("visible", CHECKS, ids=str)
def test_the_reference_passes_the_visible_check(visible, capsys):
    torch.manual_seed(0)
    getattr(checks, visible.check)(*map(reference, visible.names))
    assert capsys.readouterr().out.count("all visible checks passed") == 1


@pytest.mark.parametrize("visible", CHECKS, ids=str)
def test_an_unfinished_exercise_raises_its_own_not_implemented_error(visible):
    args = [unfinished(visible.chapter, visible.exercise, name) for name in visible.names]
    names = "|".join(map(re.escape, visible.names))
    with pytest.raises(checks.NotWrittenYet, match=rf"^({names})(\.\w+)? is not written yet"):
        getattr(checks, visible.check)(*args)
