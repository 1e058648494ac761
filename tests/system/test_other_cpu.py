"""conftest.py's run as on another CPU (--other-cpu): every notebook is run a second time in a kernel with
OTHER_CPU_ENV, but for the measurement-only cells that end it (tests/other_cpu.py), which are run as is only."""
from __future__ import annotations

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from tests.helpers import ROOT
from tests.other_cpu import trailing_measurements

pytest_plugins = ["pytester"]

TIMING = "# NBVAL_IGNORE_OUTPUT\nimport time\nstart = time.perf_counter()\nprint(time.perf_counter() - start)"


def trailing(*sources: str, tags: dict[int, list[str]] | None = None) -> list[int]:
    """The indices (among the code cells) of the cells ``trailing_measurements`` finds in a notebook of these cells."""
    cells = [new_code_cell(source) for source in sources]
    for index, cell_tags in (tags or {}).items():
        cells[index].metadata["tags"] = cell_tags
    return [cells.index(cell) for cell in trailing_measurements([new_markdown_cell("# title"), *cells])]


def test_only_the_measurements_that_end_a_notebook_and_assert_nothing_are_left_out():
    assert trailing("x = 1", TIMING, TIMING) == [1, 2]
    assert trailing("x = 1", TIMING, "print(x)") == []  # a cell runs after it
    assert trailing("x = 1", "import time\nprint(time.perf_counter())") == []  # its output is compared
    assert trailing("x = 1", "import time\nprint(time.perf_counter())", tags={1: ["nbval-ignore-output"]}) == [1]
    for check in ("assert x > 0", "raise ValueError(x)", "print(below(x, 2))", "print(above(x, 0))",
                  "print(between(x, 0, 2))", "checks.check_gpt(GPT)", "print(claims.below(x, 2))",
                  "torch.testing.assert_close(x, 1)", "check_gpt(GPT)"):
        assert trailing("x = 1", TIMING, f"{TIMING}\n{check}") == [], check  # it asserts: run as on another CPU too
        assert trailing("x = 1", f"{TIMING}\n{check}", TIMING) == [2], check  # and so does every cell before it
    assert trailing("x = 1", "# NBVAL_IGNORE_OUTPUT\n%time x + 1") == []  # not Python: counted as asserting


def test_chapter_07s_timings_are_the_measurements_left_out_there():
    notebook = nbformat.read(ROOT / "solutions/07-speculative/speculative.ipynb", as_version=4)
    assert [cell.id for cell in trailing_measurements(notebook.cells)] == ["speculative-034", "speculative-035"]


def test_as_on_another_cpu_a_trailing_measurement_is_skipped_saying_why_and_an_asserting_one_still_fails(pytester, monkeypatch):
    """A planted fault: a cell whose output is ignored but that asserts something the other CPU breaks (conftest.py's
    OTHER_CPU_ENV sets MKL_CBWR=COMPATIBLE) fails there."""
    notebook = new_notebook(cells=[
        new_code_cell("x = 1"),
        new_code_cell(f"# NBVAL_IGNORE_OUTPUT\nimport os\nassert os.environ.get('MKL_CBWR') != 'COMPATIBLE'"),
        new_code_cell("# NBVAL_IGNORE_OUTPUT\nimport os\nprint(os.environ.get('MKL_CBWR'))"),
    ])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, pytester.path / "probe.ipynb")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the subprocess loads the course's conftest.py as a plugin
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider", "-p", "conftest", "--nbval",
                                           "--other-cpu", "-rfs", "probe.ipynb")
    result.assert_outcomes(passed=4, failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*FAILED probe.ipynb::other-cpu::Cell 1*",
                                 "*SKIPPED*a measurement that ends the notebook (ignored output, no assertion): run as is only*"])


def test_the_timings_take_one_round_in_the_measurements_that_end_a_notebook_as_is_and_two_as_on_another_cpu(pytester,
                                                                                                           monkeypatch):
    """conftest.py: COURSE_TIMING_ROUNDS (course_lib/bench/timing.py) is 1 from the first measurement that ends a
    notebook run as is, unset in the cells before it, and 2 in every cell run as on another CPU. Each cell writes down
    what its kernel sees, in a file named by the run (MKL_CBWR is set as on another CPU only)."""
    record = ("# NBVAL_IGNORE_OUTPUT\nimport os\nrounds = str(os.environ.get('COURSE_TIMING_ROUNDS'))\n"
              "open(os.environ.get('MKL_CBWR', 'as-is') + '-{}.txt', 'w').write(rounds)")
    notebook = new_notebook(cells=[new_code_cell("x = 1"), new_code_cell(record.format("before") + "\nassert x == 1"),
                                   new_code_cell(record.format("trailing"))])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, pytester.path / "probe.ipynb")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the subprocess loads the course's conftest.py as a plugin
    monkeypatch.delenv("COURSE_TIMING_ROUNDS", raising=False)
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider", "-p", "conftest", "--nbval",
                                           "--other-cpu", "probe.ipynb")
    result.assert_outcomes(passed=5, skipped=1)  # the measurement that ends it runs as is only
    seen = {path.stem: path.read_text() for path in pytester.path.glob("*.txt")}
    assert seen == {"as-is-before": "None", "as-is-trailing": "1", "COMPATIBLE-before": "2"}
