"""What the tests share: the repository root, the course's tolerance policy, notebook helpers.

Tolerance policy (stated once, used by every test and every learner check): float32 parity
is asserted with rtol = atol = 1e-5 unless a test says why it needs more. The constants
live in course_lib.checks so the notebooks' checks and these tests cannot disagree.
"""
from __future__ import annotations

import json
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

