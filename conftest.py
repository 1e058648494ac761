"""Session-wide pytest settings, whatever is run (tests/ or solutions/): nbval as on another CPU (--other-cpu), one
round of the timings that end a notebook run as is (TRAILING_TIMING_ENV), and the order in which xdist's workers get
the files, measured by the last full run (tests/schedule.py, --record-durations). The tests' fixtures are in
tests/conftest.py."""
from __future__ import annotations

import os

import pytest
from nbval.plugin import IPyNbFile

from tests.other_cpu import trailing_measurements
from tests.schedule import OTHER_CPU, DurationRecorder, LongestFirstPlugin, SkipSlowerThan

#: Another CPU's float rounding, on any machine: ATen's generic kernels instead of AVX2/AVX-512, MKL's vendor-neutral
#: path, oneDNN without AVX. With --other-cpu (`make test`), nbval runs every notebook a second time, in a kernel
#: started with these: no stored output may show a number that the CPU's rounding decides. Those tests' ids read
#: ``solutions/NN-name/name.ipynb::other-cpu::Cell N``.
OTHER_CPU_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}
#: And at most 2 rounds of every alternating timing (COURSE_TIMING_ROUNDS, course_lib/bench/timing.py): there, what is
#: timed is the generic kernels, nbval compares no timing (tests/nbval_sanitize.cfg), and a timing is read only by
#: asserts that it beat no bound (slower rounds cannot break them) or that one contender's best or median of the
#: rounds outran another's by a wide margin (2 alternating rounds still show it; 1 round did not: a burst of load made
#: chapter 08's picked kernels 1.8 x F.linear).
OTHER_CPU_TIMING_ENV = {"COURSE_TIMING_ROUNDS": "2"}
#: The measurements that end a notebook (tests/other_cpu.py), run as is only, time one round: nothing reads what they
#: time (nbval ignores their output, they assert nothing, no cell after them reads it); run as is, they check that they
#: run. Their stored outputs come from `course execute`, which times every round.
TRAILING_TIMING_ENV = {"COURSE_TIMING_ROUNDS": "1"}


def pytest_addoption(parser):
    parser.addoption("--other-cpu", action="store_true",
                     help="with --nbval: run every notebook once more, its kernel as on another CPU (conftest.py OTHER_CPU_ENV)")
    parser.addoption("--record-durations", action="store_true",
                     help="write the seconds each unit of work took into tests/durations.json, the order of the next "
                          "runs (tests/schedule.py; `make test` does)")
    parser.addoption("--skip-slower-than", type=float, metavar="SECONDS",
                     help="leave out the units of work (tests/schedule.py) that took longer than SECONDS in the run "
                          "recorded in tests/durations.json (`make quick`); the summary lists them")


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):  # its scheduler hook is unknown to pytest without xdist
        config.pluginmanager.register(LongestFirstPlugin(), "longest-first")
    if config.option.record_durations and not hasattr(config, "workerinput"):  # the controller sees every report
        config.pluginmanager.register(DurationRecorder(config.rootpath), "record-durations")
    if config.option.skip_slower_than is not None:
        config.pluginmanager.register(SkipSlowerThan(config.option.skip_slower_than), "skip-slower-than")


def pytest_collect_file(file_path, parent):
    """With --other-cpu, each notebook that nbval collects is collected a second time, to run as on another CPU."""
    options = parent.config.option
    if file_path.suffix == ".ipynb" and options.other_cpu and (options.nbval or options.nbval_lax):
        try:
            path = file_path.relative_to(parent.config.rootpath).as_posix()
        except ValueError:  # a notebook outside the repository, named on the command line
            path = file_path.as_posix()
        return OtherCpuNotebook.from_parent(parent, path=file_path, nodeid=f"{path}::{OTHER_CPU}")
    return None


@pytest.hookimpl(trylast=True)  # after the notebook's own set-up, which starts its kernel
def pytest_runtest_setup(item):
    """Run as is, a notebook's kernel gets TRAILING_TIMING_ENV just before the first of the measurements that end it."""
    notebook = getattr(item, "parent", None)
    if not isinstance(notebook, IPyNbFile) or isinstance(notebook, OtherCpuNotebook):
        return
    trailing = trailing_measurements(notebook.nb.cells)
    if trailing and item.cell is trailing[0]:
        message = notebook.kernel.execute_cell_input(f"__import__('os').environ.update({TRAILING_TIMING_ENV!r})",
                                                     allow_stdin=False)
        notebook.kernel.await_reply(message, timeout=60)
        notebook.kernel.await_idle(message, timeout=60)


class OtherCpuNotebook(IPyNbFile):
    """nbval's notebook, its kernel started with OTHER_CPU_ENV (the test process's own variables are restored).

    The measurement-only cells that end a notebook (tests/other_cpu.py: chapter 07's timings, for one) are run
    as is only: as on another CPU they have nothing to check, no output nbval compares, no assertion, no later cell
    that reads what they computed; their items are reported as skipped, saying so."""

    def collect(self):
        items = list(super().collect())
        skipped = {id(cell) for cell in trailing_measurements(self.nb.cells)}
        for item in items:
            if id(item.cell) in skipped:
                item.add_marker(pytest.mark.skip(reason="a measurement that ends the notebook (ignored output, no assertion): "
                                                        "run as is only"))
        return items

    def setup(self):
        environment = {**OTHER_CPU_ENV, **OTHER_CPU_TIMING_ENV}
        saved = {name: os.environ.get(name) for name in environment}
        os.environ.update(environment)
        try:
            super().setup()
        finally:
            for name, value in saved.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
