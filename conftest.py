"""Session-wide pytest settings, whatever is run (tests/ or solutions/): nbval as on another CPU (--other-cpu), and
the order in which xdist's workers get the files, measured by the last full run (tests/schedule.py,
--record-durations). The tests' fixtures are in tests/conftest.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from nbval.plugin import IPyNbFile

from tests.schedule import OTHER_CPU, DurationRecorder, LongestFirstPlugin, read_durations, round_trip_files, unit_of

#: Another CPU's float rounding, on any machine: ATen's generic kernels instead of AVX2/AVX-512, MKL's vendor-neutral
#: path, oneDNN without AVX. With --other-cpu (`make test`), nbval runs every notebook a second time, in a kernel
#: started with these: no stored output may show a number that the CPU's rounding decides. Those tests' ids read
#: ``solutions/NN-name/name.ipynb::other-cpu::Cell N``.
OTHER_CPU_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}


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


def slower_units(config) -> dict[str, float]:
    """The recorded units slower than --skip-slower-than, under the paths this run was given."""
    given = [Path(arg.split("::", 1)[0]).resolve() for arg in config.args] or [config.rootpath]

    def under_given(unit: str) -> bool:
        path = (config.rootpath / unit.split("::", 1)[0]).resolve()
        return any(folder == path or folder in path.parents for folder in given)

    return {unit: seconds for unit, seconds in read_durations().items()
            if seconds > config.option.skip_slower_than and under_given(unit)}


def pytest_collection_modifyitems(config, items):
    """With --skip-slower-than: deselect the tests of the units that the last recorded run found slower."""
    if config.option.skip_slower_than is None:
        return
    slow, round_trips = slower_units(config), round_trip_files(item.nodeid for item in items)
    left_out = [item for item in items if unit_of(item.nodeid, round_trips) in slow]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if unit_of(item.nodeid, round_trips) not in slow]


def pytest_terminal_summary(terminalreporter, config):
    if config.option.skip_slower_than is None or hasattr(config, "workerinput"):
        return
    slow = slower_units(config)
    terminalreporter.write_line(f"--skip-slower-than {config.option.skip_slower_than:g}: left out {len(slow)} units of work "
                                f"that took {sum(slow.values()) / 60:.0f} min in the recorded run (`make test` runs them):")
    for unit, seconds in sorted(slow.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"  {seconds:5.0f} s  {unit}")


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


class OtherCpuNotebook(IPyNbFile):
    """nbval's notebook, its kernel started with OTHER_CPU_ENV (the test process's own variables are restored)."""

    def setup(self):
        saved = {name: os.environ.get(name) for name in OTHER_CPU_ENV}
        os.environ.update(OTHER_CPU_ENV)
        try:
            super().setup()
        finally:
            for name, value in saved.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
