"""A failed check reads as one message, in the notebook, in Validate and in `course check`.

* In a kernel (what JupyterLab shows): a check's failure is the message alone, one line, without the check's frames,
  its source or an exception chained under it; an unfinished exercise's check says "<name> is not written yet".
  Run All (nbclient, like JupyterLab, honours the release's ``raises-exception`` tag) goes on to the last cell.
* nbgrader's Validate (the lab's button) reports every failed test cell of that notebook, with the same message.
* `course check`'s report prints a test's whole message, however long, and says "not written yet" for a stub.
"""
from __future__ import annotations

import re

import nbformat
import pytest
from nbclient import NotebookClient

from course_lib import checks, grading
from course_lib.grading import reports

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _graded(source: str, grade_id: str):
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["nbgrader"] = {"grade": True, "grade_id": grade_id, "locked": True, "points": 1, "solution": False,
                                 "task": False, "schema_version": 3}
    cell.metadata["tags"] = [grading.RUNS_ON]
    return cell


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """A learner's notebook: an unfinished exercise, a wrong one, an error in the learner's code turned into a
    failed check (raised while handling it), each under a tagged visible test; a last cell after them all."""
    new = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook(cells=[
        new("import torch\nfrom course_lib import checks"),
        new("def masked_softmax(scores, mask=None):\n    # YOUR CODE HERE\n    raise NotImplementedError()"),
        _graded("checks.check_masked_softmax(masked_softmax)", "stub-visible"),
        new("def buggy(scores, mask=None):\n    return torch.softmax(scores, dim=0)  # normalises over queries"),
        _graded("checks.check_masked_softmax(buggy)", "buggy-visible"),
        _graded('checks.call_learner(lambda: torch.ones(2, 3) @ torch.ones(4, 5), "f(x)", "use x @ w.T")',
                "chained-visible"),
        new('print("the last cell ran")'),
    ])
    path = tmp_path_factory.mktemp("learner") / "learner.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def run_all(notebook):
    nb = nbformat.read(notebook, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}).execute()
    return nb


def _errors(nb) -> dict[str, dict]:
    return {cell.metadata["nbgrader"]["grade_id"]: output for cell in nb.cells if "nbgrader" in cell.metadata
            for output in cell.outputs if output.output_type == "error"}


def test_run_all_reaches_the_last_cell(run_all):
    assert run_all.cells[-1].outputs[0]["text"] == "the last cell ran\n"
    assert set(_errors(run_all)) == {"stub-visible", "buggy-visible", "chained-visible"}


@pytest.mark.parametrize("grade_id,ename,message", [
    ("stub-visible", "NotWrittenYet", r"^NotWrittenYet: masked_softmax is not written yet: its code still raises NotImplementedError\. Write it and run its cell\.$"),
    ("buggy-visible", "CheckFailed", r"sums to \d\.\d+, expected 1"),
    ("chained-visible", "CheckFailed", r"f\(x\) raised RuntimeError: mat1 and mat2 shapes cannot be multiplied .*\(use x @ w\.T\)$"),
])
def test_a_failed_check_in_a_kernel_is_its_message_alone(run_all, grade_id, ename, message):
    output = _errors(run_all)[grade_id]
    assert output["ename"] == ename
    lines = [ANSI.sub("", line) for line in output["traceback"]]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0] == f"{ename}: {output['evalue']}" and re.search(message, lines[0]), lines[0]
    assert not re.search(r"Traceback|course_lib|During handling|File \"", lines[0])


def test_validate_reports_every_failed_check_with_its_message(notebook):
    """nbgrader's Validate (the lab's button; nbgrader runs every cell whatever its tags) on the same notebook."""
    from nbgrader.validator import Validator

    failed = Validator().validate(str(notebook))["failed"]
    assert len(failed) == 3, failed
    errors = [ANSI.sub("", item["raw_error"]) for item in failed]
    assert errors[0].startswith("NotWrittenYet: masked_softmax is not written yet")
    assert all(len(error.splitlines()) == 1 and "Traceback" not in error for error in errors), errors


def test_explain_names_the_unfinished_function():
    """`course check`'s message for a hidden test that calls a stub directly (the clean room uses ``explain``)."""
    class Attention:
        def forward(self, x):
            raise NotImplementedError()

    def masked_softmax(scores, mask=None):
        raise NotImplementedError()

    for call, name in ((lambda: masked_softmax(None), "masked_softmax"), (lambda: Attention().forward(1), "Attention.forward")):
        with pytest.raises(NotImplementedError) as error:
            call()
        assert checks.explain(error.value).startswith(f"NotWrittenYet: {name} is not written yet"), checks.explain(error.value)
    assert checks.explain(checks.CheckFailed("row 0 sums to 2")) == "CheckFailed: row 0 sums to 2"
    assert checks.explain(ValueError("k must be >= 1")) == "ValueError: k must be >= 1"


def test_course_checks_report_prints_the_whole_message():
    long = ("When the max grows from m_old to m_new, everything summed so far was exp(x - m_old): multiply it by "
            "exp(m_old - m_new). " * 4 + "THE END")
    result = reports.NotebookResult("alice", "14-tiled-attention", "tiled_attention",
                                    [reports.TestResult("online_softmax-visible", 0, 1, long),
                                     reports.TestResult("online_softmax-rescale", 1, 1)])
    report = reports.format_report(result)
    assert "THE END" in report and "..." not in report
    assert " ".join(report.split()).count(" ".join(long.split())) == 1  # every word, in order, wrapped
    assert max(map(len, report.splitlines())) <= 120
