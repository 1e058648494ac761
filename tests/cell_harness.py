"""Run a chapter's test cells directly (no nbgrader) against its reference solutions with planted bugs.

Fast companion of the nbgrader round trips (tests/chapters/chNN/test_grading_NN.py): each planted bug must
fail exactly the test cells documented to target it, and correct alternatives must pass all.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import load_notebook, nbgrader_cells, strip_solution_markers


class TestCells:
    """The test cells and reference solutions of one notebook, and a namespace like the notebook's."""

    __test__ = False  # not a pytest test class

    def __init__(self, source: Path, namespace: dict):
        self.cells = {gid: "".join(c["source"]) for gid, c in nbgrader_cells(load_notebook(source)).items()}
        self.reference = {gid.split("-")[0]: strip_solution_markers(src) for gid, src in self.cells.items()
                          if gid.endswith("-solution")}
        self.namespace = namespace

    def cells_of(self, exercise: str) -> list[str]:
        return [gid for gid in self.cells if gid.startswith(f"{exercise}-") and not gid.endswith("-solution")]

    def mutate(self, exercise: str, *replacements: tuple[str, str]) -> str:
        """The reference solution of ``exercise`` with each (old, new) replacement applied."""
        code = self.reference[exercise]
        for old, new in replacements:
            assert old in code, f"the planted bug no longer applies to {exercise}: {old!r} not found"
            code = code.replace(old, new)
        return code

    def _with(self, solution: str) -> dict:
        """The namespace after every reference solution, then ``solution``."""
        namespace = dict(self.namespace)
        for code in self.reference.values():
            exec(code, namespace)  # noqa: S102 - the notebook's own reference code
        exec(solution, namespace)  # noqa: S102
        return namespace

    def failure_message(self, grade_id: str, solution: str) -> str:
        """The message of the AssertionError that test cell ``grade_id`` raises with ``solution`` in place."""
        try:
            exec(self.cells[grade_id], self._with(solution))  # noqa: S102
        except AssertionError as failure:
            return str(failure)
        raise AssertionError(f"{grade_id} passed: expected it to fail")

    def failing_tests(self, exercise: str, solution: str) -> set[str]:
        """Run every reference solution, then ``solution`` for ``exercise``, then its test cells; return those that fail."""
        namespace = self._with(solution)
        failed = set()
        for grade_id in self.cells_of(exercise):
            torch.manual_seed(0)
            try:
                exec(self.cells[grade_id], dict(namespace))  # noqa: S102
            except Exception:  # noqa: BLE001 - any exception fails a test cell, as in nbgrader
                failed.add(grade_id)
        return failed
