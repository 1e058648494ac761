"""The grader's rules, tested directly (fast): who is charged for a cell, what counts as using the reference."""
from __future__ import annotations

import json

import pytest

from course_lib.grading import _exercise_of_cell, definitions_only
from course_lib.recheck import forbidden_use, student_definitions


def cell(cell_id, source="", grade_id=None, solution=False, grade=False):
    meta = {"nbgrader": {"grade_id": grade_id, "solution": solution, "grade": grade}} if grade_id else {}
    return {"id": cell_id, "cell_type": "code", "source": source, "metadata": meta, "outputs": []}


@pytest.fixture
def notebook(tmp_path):
    cells = [cell("sol", grade_id="additive-solution", solution=True), cell("train"), cell("mine"),
             cell("test", grade_id="additive-mask", grade=True)]
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    return path


@pytest.mark.parametrize("cell_id,charged", [("sol", "additive"), ("test", "additive"), ("train", None), ("mine", "additive")])
def test_course_cells_are_never_charged_to_an_exercise_but_student_cells_are(notebook, cell_id, charged):
    course_cells = {"sol", "train", "test"}  # "mine" was added by the student
    assert _exercise_of_cell(notebook, cell_id, course_cells) == charged


@pytest.mark.parametrize("source,flagged", [
    ("from course_lib.attention import masked_softmax", True),
    ("import course_lib", True),
    ("masked_softmax = course_lib.attention.masked_softmax", True),
    ("m = __import__('course' + '_lib')", True),
    ("import importlib\nm = importlib.import_module('x')", True),
    ("def f(x):\n    return x  # course_lib is not used here", False),
    ("import torch\ndef f(x):\n    return torch.softmax(x, -1)", False),
])
def test_forbidden_use_of_the_reference_code(source, flagged):
    assert bool(forbidden_use(source)) == flagged


def test_defusing_keeps_definitions_and_drops_top_level_statements():
    source = "import os\ndef f():\n    return 1\nos._exit(1)\nclass A:\n    pass\n"
    kept = definitions_only(source)
    assert "def f" in kept and "class A" in kept and "os._exit" not in kept and "import os" in kept


def test_the_recheck_loads_definitions_and_constants_but_no_patches():
    source = "import torch\nEPS = 1e-9\ntorch.allclose = lambda *a, **k: True\nX = make()\ndef f(x):\n    return x + EPS\n"
    kept = student_definitions(source)
    assert "EPS = 1e-09" in kept and "def f" in kept
    assert "allclose" not in kept and "make()" not in kept


def test_the_recheck_accepts_a_solution_that_takes_an_optimizer_step(tmp_path):
    """torch imports torch._dynamo lazily at the first optimizer step, which re-binds torch attributes:
    that must not be mistaken for the student patching torch."""
    from course_lib.recheck import recheck

    step = ("def one_step(model):\n"
            "    opt = torch.optim.AdamW(model.parameters(), lr=0.1)\n"
            "    model(torch.ones(1, 2)).sum().backward()\n"
            "    opt.step()\n"
            "    return model\n")
    test = ("model = torch.nn.Linear(2, 1)\nbefore = model.weight.detach().clone()\n"
            "assert not torch.allclose(one_step(model).weight, before)\n")
    cells = [cell("setup", "import torch"), cell("sol", step, grade_id="step-solution", solution=True),
             cell("test", test, grade_id="step-visible", grade=True)]
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert recheck(path, path, timeout=120, sandboxed=False) == {"step-visible": (True, "")}
