"""nbgrader's Execute preprocessor, plus a trusted record of what ran and an output budget.

Runs inside the nbgrader process (never in the student's kernel). For each cell it writes
``start <cell id>`` before and ``done <cell id>`` after execution to ``progress_file``, so
that when a kernel dies or will not stop, the grader knows which cell did it. A cell whose
outputs exceed ``max_output_bytes`` keeps only the outputs before that point and is
recorded as ``flood <cell id>``.
"""
from __future__ import annotations

import asyncio
import json

from nbgrader.preprocessors import Execute
from traitlets import Integer, Unicode


class GuardedExecute(Execute):
    progress_file = Unicode("", help="file to record cell progress in (trusted, outside the kernel's reach)").tag(config=True)
    max_output_bytes = Integer(1_000_000, help="output bytes one cell may produce before the rest is dropped").tag(config=True)

    def _record(self, event: str, cell) -> None:
        if self.progress_file:
            with open(self.progress_file, "a") as fh:
                fh.write(f"{event} {cell.get('id', '')}\n")

    def preprocess_cell(self, cell, resources, index):
        self._output_bytes, self._flooded = 0, False
        self._record("start", cell)
        cell, resources = super().preprocess_cell(cell, resources, index)
        self._record("done", cell)
        return cell, resources

    def output(self, outs, msg, display_id, cell_index):
        self._output_bytes += len(json.dumps(msg.get("content", {})))
        if self._output_bytes > self.max_output_bytes:
            if not self._flooded:  # record it now (the cell may never finish) and stop the kernel's loop
                self._flooded = True
                self._record("flood", self.nb.cells[cell_index])
                asyncio.ensure_future(self.km.interrupt_kernel())
            return None
        return super().output(outs, msg, display_id, cell_index)
