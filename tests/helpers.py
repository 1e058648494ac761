"""What the tests share: the repository root, the course's tolerance policy, notebook helpers.

Tolerance policy (stated once, used by every test and every learner check): float32 parity
is asserted with rtol = atol = 1e-5 unless a test says why it needs more. The constants
live in course_lib.checks so the notebooks' checks and these tests cannot disagree.
"""
from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import torch

from course_lib.checks import ATOL, RTOL

ROOT = Path(__file__).resolve().parents[1]


def assert_parity(actual, expected, rtol: float = RTOL, atol: float = ATOL) -> None:
    """float32 parity under the course tolerance policy."""
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=atol)


def load_notebook(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def nbgrader_cells(notebook: dict) -> dict[str, dict]:
    """grade_id -> cell for every nbgrader cell of a notebook."""
    return {c["metadata"]["nbgrader"]["grade_id"]: c for c in notebook["cells"]
            if "nbgrader" in c.get("metadata", {})}


def strip_solution_markers(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))


def failing(exercise: str, *names: str) -> set[str]:
    """The grade ids of an exercise's tests that a planted bug must fail: failing("gpt", "visible", "tying")."""
    return {f"{exercise}-{name}" for name in names}



def mutant(obj, *replacements: tuple[str, str], namespace: dict | None = None):
    """The course's function or class `obj` with each (old, new) replacement applied to its source: a planted bug.

    Defined afresh in a copy of `namespace` (default: the globals of obj's module); each `old` must be in the source,
    so that a planted bug cannot silently stop being planted when the reference changes."""
    source = textwrap.dedent(inspect.getsource(obj))
    for old, new in replacements:
        assert old in source, f"{old!r} is not in {obj.__name__}"
        source = source.replace(old, new)
    namespace = dict(vars(inspect.getmodule(obj)) if namespace is None else namespace)
    exec(source, namespace)  # noqa: S102 - the course's own code with a planted bug
    return namespace[obj.__name__]
