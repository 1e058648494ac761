"""Shared fixtures and the course's tolerance policy.

Tolerance policy (stated once, used by every test and every learner check): float32 parity
is asserted with rtol = atol = 1e-5 unless a test says why it needs more. The constants
live in course_lib.checks so the notebooks' checks and these tests cannot disagree.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
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


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(0)


@pytest.fixture
def one_thread():
    """One torch thread for the test, as in the notebooks (several threads on a busy 2-core machine make tiny
    models crawl); the thread count is restored afterwards. Use with pytest.mark.usefixtures("one_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
